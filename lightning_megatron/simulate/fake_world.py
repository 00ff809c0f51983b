"""One rank of an N-rank job in this process, with nothing real behind its tensors or its process groups.

``lightning-megatron simulate`` runs the strategy's own set-up and training step for one rank at a time:

* torch's fake process group (``FakeStore``) at the job's world size and this rank's number, so every group,
  mesh and collective the strategy makes has the sizes and ranks it would have; collectives move nothing;
* ``FakeTensorMode``: tensors with shapes, dtypes and devices but no memory, so a 175B model's stage costs nothing;
* :class:`KnownValues`: the values of *small* tensors (at most ``SMALL_NUMEL`` elements: flags, counts, sizes)
  computed for real beside their fake twins, so that the program's host reads (``.item()``, ``bool()``,
  ``.tolist()``) see what this rank would see where that does not depend on other ranks' data or on the big
  tensors. A read of anything else is answered with a healthy step's stand-in and counted: ``True`` for a boolean
  (all finite), 1 for a number (a count, a scale); and a healthy step's overflow check (fp16's) finds nothing: the
  flag it writes keeps its known zero;
* :class:`StageMailbox`: what pipeline stages tell each other as Python objects (torch's shape inference, the loss
  broadcast), carried from one simulated rank to the next in the order the simulation runs them.

The device type of the fake tensors is the one torch can run autograd on here: ``cuda`` where torch was built
with CUDA, else ``cpu`` (a CPU build of torch cannot run autograd on fake CUDA tensors). The kernels whose memory
differs between the two are the attention's: on fake CPU tensors :func:`gpu_attention` sends scaled-dot-product
attention without a mask to FlashAttention's op, as a GPU runs it (its output, log-sum-exp and random state kept for
backward, dropout included), not to the CPU's kernel, which under attention dropout falls back to materialising the
``s x s`` scores and mask.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

#: Tensors up to this many elements keep real values beside their fake twins (:class:`KnownValues`).
SMALL_NUMEL = 64
_HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
# Checks that write a flag (a known zero) only when something is not finite: a healthy step leaves it as it was.
_HEALTHY_CHECKS = (torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default,)


def simulation_device() -> torch.device:
    """``cuda`` where this torch can run autograd on fake CUDA tensors (a CUDA build), else ``cpu``."""
    return torch.device("cuda" if torch.backends.cuda.is_built() else "cpu")


class KnownValues:
    """Runs each op whose tensors are all small and known for real too (see the module docstring), and answers the
    host reads: from the real value where it is known, else with a stand-in (``stand_ins`` counts them). The
    simulation's dispatch mode (``records.Observed``) hands it every op."""

    def __init__(self) -> None:
        self.values = WeakTensorKeyDictionary()
        self.host_reads = 0
        self.stand_ins = 0

    def _real(self, value: Any) -> Any:
        if not isinstance(value, Tensor) or not isinstance(value, FakeTensor):
            return value  # a real tensor (a constant the program made from Python values) or not a tensor
        known = self.values.get(value)
        if known is None:
            raise LookupError
        return known

    def run(self, func, args, kwargs) -> Any:
        """``func``'s result (a host read's answer), its small results known."""
        if func in _HOST_READS:
            return self._read(func, args[0])
        out = func(*args, **kwargs)
        if func.namespace in COLLECTIVE_NAMESPACES or func in _HEALTHY_CHECKS:
            return out  # the fake group moves nothing, a healthy check sets no flag: the values stay as they were
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        written = [a for a, argument in zip(args, func._schema.arguments)
                   if isinstance(a, Tensor) and argument.alias_info is not None and argument.alias_info.is_write]
        if all(t.numel() <= SMALL_NUMEL for t in outputs + written) and (outputs or written):
            try:
                with unset_fake_temporarily():
                    real = func(*tree_map(self._real, args), **tree_map(self._real, kwargs))
            except Exception:  # an input not known (or an op with no real twin here): nothing known of the results
                real = None
            if real is not None:
                for tensor, value in zip(outputs, [t for t in tree_flatten(real)[0] if isinstance(t, Tensor)]):
                    self.values[tensor] = value
                return out
        for tensor in outputs + written:
            self.values.pop(tensor, None)
        return out

    def _read(self, func, tensor: Tensor) -> Any:
        self.host_reads += 1
        known = self.values.get(tensor)
        if known is not None:
            with unset_fake_temporarily():
                return bool(known) if func is torch.ops.aten.is_nonzero.default else known.item()
        self.stand_ins += 1
        if func is torch.ops.aten.is_nonzero.default or tensor.dtype == torch.bool:
            return True
        return 1.0 if tensor.dtype.is_floating_point else 1


class StageMailbox:
    """The Python objects pipeline stages exchange, from the simulated ranks that sent them to those simulated after.

    * torch's shape inference sends each stage's output metadata forward and its input gradients' backward. A stage
      whose neighbour was not simulated yet gets the latest forward metadata any stage sent (the boundaries between
      transformer stages carry the same hidden states), and backward metadata made from what it sent forward.
    * ``broadcast_object_list`` (the pipeline's loss totals, from the last stage): the latest broadcast; before any,
      the receiver keeps its own objects, as the fake group leaves a received tensor as it was.
    """

    def __init__(self) -> None:
        self._meta: dict[tuple[int, int], list] = {}
        self._latest_forward = None
        self._latest_broadcast: Optional[list] = None

    def _send_meta(self, stage, meta, dst_stage: int) -> None:
        self._meta.setdefault((stage.stage_index, dst_stage), []).append(meta)
        if dst_stage > stage.stage_index:
            self._latest_forward = meta

    def _recv_meta(self, stage, src_stage: int):
        from torch.distributed.pipelining._utils import _StageBackwardMeta

        queue = self._meta.get((src_stage, stage.stage_index))
        if queue:
            return queue.pop(0)
        if src_stage < stage.stage_index or self._latest_forward is None:
            if self._latest_forward is None:
                raise RuntimeError(f"Simulating pipeline stage {stage.stage_index} needs the metadata of stage "
                                   f"{src_stage}'s output: simulate a rank of the first pipeline stage first.")
            return self._latest_forward
        sent = self._meta.get((stage.stage_index, src_stage))
        forward = sent[-1] if sent else self._latest_forward
        return _StageBackwardMeta(tuple(m if m.requires_grad else None for m in forward.forward_metas))

    def _broadcast_object_list(self, object_list: list, src: Optional[int] = None, group=None, device=None,
                               group_src: Optional[int] = None, **_) -> None:
        if group_src is not None:
            src = dist.get_global_rank(group, group_src)
        if src == dist.get_rank():
            self._latest_broadcast = list(object_list)
        elif self._latest_broadcast is not None:
            object_list[:] = self._latest_broadcast

    @contextlib.contextmanager
    def delivering(self) -> Iterator[None]:
        from torch.distributed.pipelining.stage import PipelineStage

        mailbox = self
        with mock.patch.object(PipelineStage, "_send_meta", lambda stage, meta, dst: mailbox._send_meta(stage, meta, dst)), \
                mock.patch.object(PipelineStage, "_recv_meta", lambda stage, src: mailbox._recv_meta(stage, src)), \
                mock.patch.object(dist, "broadcast_object_list", self._broadcast_object_list):
            yield


def fake_tensors() -> FakeTensorMode:
    """Fake tensors that real ones (the program's constants) may meet."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def _flash_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                     enable_gqa: bool = False, _sdpa=F.scaled_dot_product_attention) -> Tensor:
    """Scaled-dot-product attention without a mask as FlashAttention's op (``aten._scaled_dot_product_flash_attention``,
    whose fake kernel needs no GPU; grouped key/value heads as they are); with a mask, torch's own choice."""
    if attn_mask is not None:
        return _sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                              scale=scale)[0]


def gpu_attention() -> ContextManager:
    """``F.scaled_dot_product_attention`` as a GPU runs it (:func:`_flash_attention`), for every caller while active
    (a patch, not a function mode: a recomputed layer's forward runs in backward, where modes may not be)."""
    return mock.patch.object(F, "scaled_dot_product_attention", _flash_attention)
