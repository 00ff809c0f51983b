"""QLoRA's frozen base: the weights LoRA adapts held in 4-bit NF4 (torchao's ``NF4Tensor``), on every layout alike.

torchao quantises a weight in blocks of ``block_size`` consecutive elements (row-major): each element becomes the
index of the nearest of 16 NormalFloat levels times its block's absmax, and the absmaxes themselves are "double
quantised": their mean over the *whole tensor* is subtracted and each run of ``scaler_block_size`` of them is
stored in int8 with one factor. Quantising each tensor-parallel shard on its own would therefore give another
base at tp=2 than at tp=1 (another mean, other factors). Here the global weight is quantised once, by torchao,
and each rank takes exactly its elements' codes and its blocks' scalers, factors and the global mean
(:func:`shard_nf4`); its dequantised shard is, bit for bit, that rank's part of torchao's round trip of the
global weight (``to_nf4(w).get_original_weight()``), so every layout computes with the same base.

A rank's blocks must be whole blocks of the global tensor: ``block_size`` must divide the input features (and a
row-parallel rank's share of them). A run of local blocks that shares one global factor is what a local
``NF4Tensor`` calls a scaler block: the largest divisor ``g`` of ``scaler_block_size`` for which every aligned run
of ``g`` local blocks lies in one global scaler block (``scaler_block_size`` itself for whole rows of a
column-parallel split; fewer, so more factors, where a row-parallel split cuts the global scaler blocks).

:class:`Nf4Gemms` runs a quantised layer's GEMMs (the layers' ``gemms`` seam, as FP8's): the shard is
dequantised to the input's dtype for the forward GEMM and again for the input gradient, and the dense copy is
dropped in between (autograd keeps the 4-bit shard); the base gets no gradient. :func:`quantize_bases` is the
strategy's step (after the tensor-parallel and pipeline split), :func:`quantize_in_place` the one-process one.

torchao is the ``[qlora]`` extra (``pip install 'lightning-megatron[qlora]'``).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.parallel.shards import TensorShard, shard_of
from lightning_megatron.tensor_parallel.fp8 import HighPrecisionGemms
from lightning_megatron.tensor_parallel.torchao_import import import_torchao

#: What ``LoRAConfig.quantize_base`` marks on each adapted layer (a public attribute: it survives the swap).
MARK = "base_quantization"


@dataclass(frozen=True)
class NF4Settings:
    """How the frozen base is quantised: NF4 in blocks of ``block_size`` elements, their absmaxes double-quantised
    in runs of ``scaler_block_size`` (QLoRA's and torchao's defaults: 64 and 256). ``LoRAConfig(quantize_base=...)``
    takes ``"nf4"`` (the defaults) or a dict ``{"format": "nf4", "block_size": 32, "scaler_block_size": 128}``."""

    block_size: int = 64
    scaler_block_size: int = 256

    def __post_init__(self) -> None:
        if self.block_size < 2 or self.block_size % 2 or self.scaler_block_size < 1:
            raise ValueError(f"NF4 block_size must be a positive even number and scaler_block_size positive, got "
                             f"block_size={self.block_size}, scaler_block_size={self.scaler_block_size}.")

    @classmethod
    def of(cls, value: Union["NF4Settings", str, Mapping[str, Any], None]) -> Optional["NF4Settings"]:
        if value is None or isinstance(value, cls):
            return value
        if value == "nf4":
            return cls()
        if isinstance(value, Mapping) and value.get("format", "nf4") == "nf4":
            unknown = set(value) - {"format", "block_size", "scaler_block_size"}
            if not unknown:
                return cls(**{k: int(v) for k, v in value.items() if k != "format"})
        raise ValueError(f"quantize_base must be 'nf4' or a dict {{'format': 'nf4', 'block_size': ..., "
                         f"'scaler_block_size': ...}}, got {value!r}.")

    def as_setting(self) -> Union[str, dict[str, Any]]:
        """What ``of`` reads back (a YAML ``quantize_base:`` value)."""
        if self == NF4Settings():
            return "nf4"
        return {"format": "nf4", "block_size": self.block_size, "scaler_block_size": self.scaler_block_size}


def require_torchao():
    """torchao's NF4 (``torchao.quantization``: ``NF4Tensor``, ``to_nf4``)."""
    quantization = import_torchao("torchao.quantization", needed_for="QLoRA stores the frozen base in torchao's NF4",
                                  extra="qlora", without="quantize_base=None")
    return quantization.NF4Tensor, quantization.to_nf4


def check_quantizable(name: str, shape: tuple[int, ...], settings: NF4Settings) -> None:
    """torchao's conditions on the global weight, told by name with the fix (before anything is read)."""
    block, scaler = settings.block_size, settings.scaler_block_size
    numel = math.prod(shape)
    if len(shape) != 2 or shape[1] % block or numel % (block * scaler):
        raise ValueError(
            f"{name}: its weight of shape {tuple(shape)} cannot be quantised to NF4 with block_size={block} and "
            f"scaler_block_size={scaler}: block_size must divide the input features ({shape[-1]}) and "
            f"block_size * scaler_block_size the {numel} elements. Choose smaller sizes, e.g. "
            f"quantize_base={{'format': 'nf4', 'block_size': {math.gcd(block, shape[-1])}, 'scaler_block_size': "
            f"{math.gcd(scaler, max(numel // math.gcd(block, shape[-1]), 1))}}}, or leave {name} out of the LoRA targets.")


def _check_row_tiling(name: str, shard: TensorShard, block: int) -> None:
    if shard.rank_ranges is not None or shard.local_size % block:
        raise ValueError(f"{name}: a row-parallel rank holds {shard.local_size} of the {shard.global_shape[1]} input "
                         f"features, which NF4 blocks of {block} do not tile; choose a block_size that divides "
                         f"{math.gcd(shard.local_size, shard.global_shape[1])}, or another tensor_parallel_size.")


def _local_block_ids(name: str, shape: tuple[int, ...], shard: Optional[TensorShard], block: int) -> Tensor:
    """The global (row-major) block indices of this rank's blocks, in local order."""
    rows, columns = shape
    grid = torch.arange(rows * columns // block).view(rows, columns // block)
    if shard is None:
        return grid.flatten()
    if shard.dim == 1:  # a row-parallel rank: the contiguous columns [rank * local, (rank + 1) * local)
        _check_row_tiling(name, shard, block)
        coarse = dataclasses.replace(shard, global_shape=(rows, columns // block), padded_size=shard.padded_size // block)
    else:
        coarse = dataclasses.replace(shard, global_shape=(rows, columns // block))
    return coarse.local_slice(grid).flatten()


def _factor_run(shape: tuple[int, ...], shard: Optional[TensorShard], settings: NF4Settings) -> int:
    """How many consecutive local blocks share one factor: the greatest common divisor of ``scaler_block_size`` and
    every start and length (in blocks) of the runs of global blocks the rank holds, so that each aligned run of
    that many local blocks lies in one global scaler block (``scaler_block_size`` for whole-row splits; fewer where
    a row-parallel split cuts the rows). From the shard's ranges alone: the planner counts it without quantising."""
    rows, columns = shape
    block = settings.block_size
    if shard is None or shard.local_shape == shard.global_shape:  # the whole tensor: one run
        return math.gcd(settings.scaler_block_size, rows * columns // block)
    if shard.dim == 0:
        numbers = [n * columns // block for segment in shard.segments() for n in (segment.start, segment.size)]
    else:  # a run per row: rows start columns // block blocks apart
        numbers = [columns // block, *(n // block for segment in shard.segments() for n in (segment.start, segment.size))]
    return math.gcd(settings.scaler_block_size, *numbers)


def shard_nf4(name: str, weight: Tensor, shard: Optional[TensorShard], settings: NF4Settings, *,
              device: Union[torch.device, str, None] = None):
    """This rank's ``NF4Tensor`` of the global ``weight`` (module docstring): torchao quantises ``weight`` whole, and
    the rank keeps its blocks; ``shard`` (``None``: all of it) is the layer's ``TensorShard``."""
    NF4Tensor, to_nf4 = require_torchao()
    shape = tuple(weight.shape)
    check_quantizable(name, shape, settings)
    block = settings.block_size
    device = weight.device if device is None else torch.device(device)
    # On the device the layer runs on (the whole weight there for a moment: one layer's), every rank alike.
    whole = to_nf4(weight.detach().to(device).contiguous(), block, settings.scaler_block_size)
    ids = _local_block_ids(name, shape, shard, block).to(device)
    run = _factor_run(shape, shard, settings)
    local_shape = shape if shard is None else shard.local_shape
    codes = whole.quantized_data.view(-1, block // 2).index_select(0, ids).flatten()
    scalers = whole.quantized_scalers.index_select(0, ids)
    factors = whole.quantization_factor.index_select(0, ids[::run] // settings.scaler_block_size)
    meta = importlib.import_module(NF4Tensor.__module__).SubclassTensorArgs(
        torch.Size(local_shape), (local_shape[1], 1), 0, weight.dtype, device, False)
    return NF4Tensor(meta, block, ids.numel(), run, scalers, factors, whole.scaler_mean, codes, whole.nf4)


def nf4_base_bytes(name: str, weight: Tensor, settings: NF4Settings) -> int:
    """Bytes of the ``NF4Tensor`` :func:`shard_nf4` makes of a layer's ``weight`` (a parameter of the local shape,
    tagged with its shard; meta is enough), without quantising: codes (half a byte an element), an int8 scaler a
    block, a factor a run of blocks, the mean and the 16 levels (those in the weight's dtype, as torchao keeps them)."""
    shard = shard_of(weight)
    global_shape = tuple(weight.shape) if shard is None else shard.global_shape
    check_quantizable(name, global_shape, settings)
    if shard is not None and shard.dim == 1:
        _check_row_tiling(name, shard, settings.block_size)
    blocks = weight.numel() // settings.block_size
    run = _factor_run(global_shape, shard, settings)
    return weight.numel() // 2 + blocks + (blocks // run + 1 + 16) * weight.element_size()


def dequantized(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight in ``dtype``: an ``NF4Tensor`` dequantised (torchao's ``get_original_weight``), a dense one cast."""
    original = getattr(weight, "get_original_weight", None)
    return (original() if original is not None else weight).to(dtype)


class _Nf4Linear(torch.autograd.Function):
    """``F.linear`` with a 4-bit weight: dequantised for the GEMM, again for the input gradient; only the 4-bit
    shard is kept between them. The base is frozen: no weight gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        ctx.weight, ctx.has_bias = weight, bias is not None
        return NF4_GEMMS.forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_x = NF4_GEMMS.grad_input(grad, ctx.weight) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias


class Nf4Gemms(HighPrecisionGemms):
    """A quantised layer's GEMMs (``tensor_parallel.fp8.HighPrecisionGemms``' seam): the weight is this rank's
    ``NF4Tensor``, dequantised where a GEMM needs it."""

    def linear(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return _Nf4Linear.apply(x, weight, bias)

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return F.linear(x, dequantized(weight, x.dtype), bias)

    def grad_input(self, grad: Tensor, weight: Tensor) -> Tensor:
        return torch.matmul(grad, dequantized(weight, grad.dtype))

    def grad_weight(self, grad: Tensor, x: Tensor) -> Tensor:
        raise RuntimeError("A base quantised to NF4 is frozen: it has no weight gradient.")


NF4_GEMMS = Nf4Gemms()


def check_nf4_options(*, fp8: bool, tp_comm_overlap: bool) -> None:
    """The strategy options a quantised base cannot run with (both replace the layers' GEMMs)."""
    if fp8:
        raise ValueError("LoRA's quantize_base='nf4' and fp8 both set how the adapted layers' GEMMs run; set fp8=None "
                         "(QLoRA dequantises its 4-bit base to the compute dtype) or quantize_base=None.")
    if tp_comm_overlap:
        raise ValueError("LoRA's quantize_base='nf4' runs with the layers' own sequence-parallel GEMMs; set "
                         "tp_comm_overlap=False, or quantize_base=None.")


def marked_layers(module: nn.Module) -> dict[str, NF4Settings]:
    """The layers of ``module`` whose base ``LoRAConfig.quantize_base`` marked, with their settings."""
    return {name: getattr(layer, MARK) for name, layer in module.named_modules()
            if isinstance(getattr(layer, MARK, None), NF4Settings)}


def is_quantized(layer: nn.Module) -> bool:
    return getattr(layer, "gemms", None) is NF4_GEMMS


def _install(layer: nn.Module, local: Tensor) -> None:
    """The layer's ``weight`` becomes its ``NF4Tensor``: a plain attribute, no parameter (nothing steps, reduces,
    casts or saves it; ``module.to(dtype)`` leaves it as it is), and its GEMMs dequantise it."""
    del layer.weight
    layer.weight = local
    layer.gemms = NF4_GEMMS


def hold_global_weights(module: nn.Module) -> dict[str, Tensor]:
    """The full-precision weights of the marked layers, taken before ``parallelize`` cuts them (the strategy's first
    step), so that :func:`quantize_bases` quantises each whole. A base still on the meta device (no ``pretrained``
    weights: only the strategy would draw them, shard by shard) is refused, on every rank alike."""
    held = {}
    for name, settings in marked_layers(module).items():
        weight = module.get_submodule(name).weight
        check_quantizable(name, tuple(weight.shape), settings)
        if weight.is_meta:
            raise ValueError(f"{name}: quantize_base='nf4' quantises a pretrained base (GPT(pretrained=DIR, lora=...)); "
                             f"this model's base is not loaded. Give pretrained=, or set quantize_base=None.")
        held[name] = weight.detach()
    return held


def quantize_bases(module: nn.Module, held: Mapping[str, Tensor], device: Union[torch.device, str]) -> list[str]:
    """After the tensor-parallel and pipeline split: each marked layer this rank still holds gets its ``NF4Tensor``
    of ``held``'s global weight (on ``device``); returns their names."""
    quantized = []
    for name, settings in marked_layers(module).items():
        layer = module.get_submodule(name)
        local = shard_nf4(name, held[name], shard_of(layer.weight), settings, device=device)
        _install(layer, local)
        quantized.append(name)
    return quantized


def quantize_in_place(module: nn.Module) -> list[str]:
    """One process, no parallelism: every marked layer of ``module`` (real weights) quantised whole, where it is."""
    held = hold_global_weights(module)
    return quantize_bases(module, held, device=next(iter(held.values())).device if held else "cpu")


def quantized_base_bytes(module: nn.Module) -> int:
    """Bytes of this rank's quantised bases (``NF4Tensor`` pieces), which are no parameters of the module."""
    total = 0
    for _, layer in module.named_modules():
        if is_quantized(layer):
            w = layer.weight
            total += sum(t.numel() * t.element_size() for t in
                         (w.quantized_data, w.quantized_scalers, w.quantization_factor, w.scaler_mean, w.nf4))
    return total
