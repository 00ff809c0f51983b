"""Layout-invariant parameter initialisation.

A parameter's initial value depends only on the seed and its global name
(``blocks.7.mlp.fc.weight``), never on tp/pp/dp: each rank builds the full parameter
from a generator seeded by the name, then keeps its own shard. Modules may define
``initialize_parameter(name, tensor, generator)`` to choose the distribution of their
parameters (names are then relative to that module); others get
:func:`default_initializer`. A module whose own parameters have a start that only it knows (a norm whose gain is
stored as its offset from one starts at zero: ``models.norms.ZeroCenteredRMSNorm``) defines
``initialize_own_parameter`` with the same signature, which :func:`rule_for` puts before its owner's. Parameters under a child module whose name has a declared rule
(:func:`declare_child_initializer`: ``peft.adapters`` declares LoRA's ``lora_a``/``lora_b``) always follow that
rule, whichever module owns them, so this module knows no adapter and the base layer imports nothing above it.

Params on the meta device are materialised on ``device``; real params are overwritten in
place, so a single-process model and every parallel layout start identical.

The numbers are always drawn on the host (torch's CPU generator), whatever ``device`` is, so a run
initialised for CUDA starts from exactly the values of a CPU run (a CUDA generator would give other
numbers, and other ones again on another GPU model). To keep that affordable at 8B+ parameters, a
sharded parameter whose initialiser is one ``normal_``/``zero_``/``fill_`` of the whole tensor (GPT-2's,
this module's default; checked by running it on a meta tensor, :func:`_draw_of`) gets only its own
rows drawn: the generator is advanced past the rows before them (``uniform_`` consumes one number per
element, as ``normal_`` does before its transform in blocks of 16) and stops after them, and a shard
along another dimension is drawn in bounded row blocks. The values are bit-identical to drawing the
full tensor and slicing it (tested), with memory bounded by the shard instead of the full tensor. Any
other initialiser gets the full tensor as before. :func:`initialize_parameters` draws several
parameters at once on the host's threads (each draw is one sequential generator; ``normal_`` releases
the GIL).
"""

from __future__ import annotations

import contextlib
import gc
import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from lightning_megatron.parallel.shards import TensorShard, shard_of

Initializer = Callable[[str, Tensor, torch.Generator], None]
INIT_STD = 0.02
# Python attributes our code puts on parameters; whatever replaces a parameter must carry them over.
PARAMETER_TAGS = ("tensor_shard", "sequence_parallel_grad", "pipeline_tied", "pipeline_stage_uses", "tied_names",
                  "expert_parallel", "whole_expert")


# child-module name -> the rule for every parameter under such a child (see declare_child_initializer)
_CHILD_INITIALIZERS: dict[str, Initializer] = {}


def declare_child_initializer(child_names: tuple[str, ...], rule: Initializer) -> None:
    """Declare that every parameter under a child module named one of ``child_names`` (``lora_a`` in
    ``blocks.0.attn.qkv.lora_a.weight``) is initialised by ``rule``, whichever module owns it: the code that
    attaches such children declares this once (``peft.adapters`` on import), and every caller of
    :func:`local_initial_values` (ZeRO-3's too) then draws them by it."""
    for child in child_names:
        _CHILD_INITIALIZERS[child] = rule


def _declared_rule(name: str) -> Optional[Initializer]:
    return next((_CHILD_INITIALIZERS[part] for part in name.split(".") if part in _CHILD_INITIALIZERS), None)


def parameter_seed(seed: int, name: str) -> int:
    """A stable seed per (run seed, global name): crc32 is identical on every machine and Python run."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63 - 1)


def default_initializer(name: str, tensor: Tensor, generator: torch.Generator) -> None:
    """GPT-2's scheme: weights ~ N(0, 0.02); biases zero; other vectors (norm gains) one."""
    if tensor.dim() >= 2:
        tensor.normal_(0.0, INIT_STD, generator=generator)
    elif name.endswith("bias"):
        tensor.zero_()
    else:
        tensor.fill_(1.0)


def rule_for(module: nn.Module, owner_rule: Initializer) -> Initializer:
    """The rule for ``module``'s own parameters: its ``initialize_own_parameter`` where it defines one, else its
    owner's (the callers of :func:`local_initial_values` walk the modules and ask this for each)."""
    return getattr(module, "initialize_own_parameter", owner_rule)


def _is_within(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def initializer_owners(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost submodules (the root included) that define their own ``initialize_parameter``."""
    owners: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if hasattr(module, "initialize_parameter") and not any(_is_within(name, o) for o, _ in owners):
            owners.append((name, module))
    return owners


def original_name(param: Tensor, name: str) -> str:
    """A tied copy on another pipeline stage (the last stage's head) is the parameter it copies: initialised
    as it, saved under its name."""
    tied = getattr(param, "tied_names", None)
    if tied is not None and name.endswith(tied[0]):
        return name[: len(name) - len(tied[0])] + tied[1]
    return name


def local_initial_values(param: Tensor, name: str, seed: int, initializer: Initializer) -> Tensor:
    """This rank's shard of the full initial value of parameter ``name``; one under a child with a declared rule
    (an adapter's: ``B = 0``, so the adapted model starts as the base model) by that rule, whichever module owns it,
    here for every caller (ZeRO-3's too). Only the shard's own values are drawn where the initialiser allows it
    (see the module docstring). An initialiser with a ``read_local(name, shard, global_shape)`` (values read from
    files: ``models.hf_weights``) returns this rank's part itself (fp32, padding zero), so no full tensor is made."""
    shard = shard_of(param)
    global_shape = shard.global_shape if shard is not None else tuple(param.shape)
    rule = _declared_rule(name) or initializer
    read_local = getattr(rule, "read_local", None)
    if read_local is not None:  # values read, not drawn (a checkpoint's tensors): it reads this rank's part itself
        return read_local(name, shard, global_shape)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    draw = _draw_of(rule, name, global_shape) if shard is not None else None
    if draw is not None:
        return _shard_values(shard, draw, parameter_seed(seed, name))
    full = torch.empty(global_shape, dtype=torch.float32)
    rule(name, full, generator)
    return full if shard is None else shard.local_slice(full)


# ------------------------------------------------------------------ drawing a shard's values only
_QUERIES = {"dim", "size", "numel", "ndimension", "__get__"}  # what an initialiser may ask without changing values
_BLOCK = 16  # torch's CPU normal_ turns its uniforms into normals in blocks of 16 (Box-Muller within a block)
_SCRATCH = 1 << 20  # elements drawn at a time when skipping or streaming (4 MiB of fp32)


@dataclass(frozen=True)
class _Draw:
    """The one call an initialiser makes on the full tensor: ``normal_(*args)``, ``zero_()`` or ``fill_(*args)``."""

    method: str
    args: tuple


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append((getattr(func, "__name__", ""), args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _draw_of(rule: Initializer, name: str, shape: tuple[int, ...]) -> Optional[_Draw]:
    """What ``rule`` does to a full tensor of ``shape``, if it is one draw this module can cut to a shard: run on a
    meta tensor (no memory, no numbers), it may ask the tensor's shape and must make exactly one call of
    ``normal_(mean, std, generator=...)`` (with the generator it was given), ``zero_()`` or ``fill_(value)``."""
    probe = torch.empty(shape, dtype=torch.float32, device="meta")
    generator = torch.Generator()
    recorder = _Recorder()
    with recorder:
        rule(name, probe, generator)
    changes = [call for call in recorder.calls if call[0] not in _QUERIES]
    if len(changes) != 1:
        return None
    method, args, kwargs = changes[0]
    if not args or args[0] is not probe:
        return None
    if method == "normal_" and kwargs.keys() == {"generator"} and kwargs["generator"] is generator:
        return _Draw(method, tuple(args[1:]))
    if method in ("zero_", "fill_") and not kwargs:
        return _Draw(method, tuple(args[1:]))
    return None


class _Stream:
    """The full tensor's values, flat, as ``normal_(*args)`` with a generator seeded ``seed`` would write them,
    drawn range by range: ``values(a, b)`` is ``full.flatten()[a:b]``, a view into one reused buffer (valid until
    the next call). The generator moves forward only; a range before its position starts it again."""

    def __init__(self, numel: int, seed: int, args: tuple) -> None:
        self.numel, self.seed, self.args = numel, seed, args
        self.generator, self.position = torch.Generator().manual_seed(seed), 0
        self.buffer = torch.empty(0, dtype=torch.float32)

    def _scratch(self, size: int) -> Tensor:
        if self.buffer.numel() < size:
            self.buffer = torch.empty(size, dtype=torch.float32)
        return self.buffer[:size]

    def values(self, start: int, stop: int) -> Tensor:
        # Draw whole blocks of 16 from a block boundary. When the size is not a multiple of 16, normal_ redraws the
        # last 16 values from 16 more uniforms: a range reaching into them is drawn to the end, 16 values or more.
        first = start - start % _BLOCK
        redrawn = self.numel - _BLOCK if self.numel % _BLOCK else self.numel
        last = self.numel if stop > redrawn else -(-stop // _BLOCK) * _BLOCK
        if last == self.numel and last - first < _BLOCK:
            first = max(0, (self.numel - _BLOCK) // _BLOCK * _BLOCK)
        if first < self.position:
            self.generator, self.position = torch.Generator().manual_seed(self.seed), 0
        self._skip(first - self.position)
        drawn = self._scratch(last - first).normal_(*self.args, generator=self.generator)
        self.position = last + (_BLOCK if last == self.numel and last % _BLOCK else 0)
        return drawn[start - first: stop - first]

    def _skip(self, count: int) -> None:
        """Consume ``count`` numbers: ``uniform_`` takes one per float32 element, as ``normal_`` does."""
        while count > 0:
            self._scratch(min(count, _SCRATCH)).uniform_(generator=self.generator)
            count -= min(count, _SCRATCH)


def _shard_values(shard: TensorShard, draw: _Draw, seed: int) -> Tensor:
    """``shard.local_slice(full)`` for ``full`` made by ``draw``, drawing no more than the shard's rows (along dim 0)
    or bounded blocks of rows (along another dimension)."""
    local = torch.zeros(shard.local_shape, dtype=torch.float32)  # padding stays zero, as local_slice leaves it
    segments = sorted(shard.segments(), key=lambda segment: segment.start)
    if draw.method != "normal_":
        for segment in segments:
            getattr(local.narrow(shard.dim, segment.local_start, segment.size), draw.method)(*draw.args)
        return local
    shape = shard.global_shape
    inner, outer = math.prod(shape[shard.dim + 1:]), math.prod(shape[:shard.dim])
    span = shape[shard.dim] * inner  # elements of one index of the leading dimensions
    stream = _Stream(math.prod(shape), seed, draw.args)
    if shard.dim == 0:
        for segment in segments:
            values = stream.values(segment.start * inner, (segment.start + segment.size) * inner)
            local.narrow(0, segment.local_start, segment.size).copy_(values.view(segment.size, *shape[1:]))
        return local
    rows = max(1, _SCRATCH // max(span, 1))
    for first in range(0, outer, rows):
        count = min(rows, outer - first)
        block = stream.values(first * span, (first + count) * span).view(count, shape[shard.dim], inner)
        target = local.view(outer, shard.local_shape[shard.dim], inner)[first:first + count]
        for segment in segments:
            target[:, segment.local_start:segment.local_start + segment.size].copy_(
                block[:, segment.start:segment.start + segment.size])
    return local


class _SkippedDefaultInit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _DEFAULT_DRAWS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


# What torch's layers draw their default values with (nn.Linear: kaiming_uniform_ and uniform_; nn.Embedding:
# normal_); every one of them defers to a TorchFunctionMode before it draws.
_DEFAULT_DRAWS = {nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_, nn.init.kaiming_uniform_,
                  nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_}


@contextlib.contextmanager
def uninitialised_build() -> Iterator[None]:
    """The building of a model whose every parameter :func:`initialize_parameters` sets afterwards, without the work
    that would be thrown away: torch's layers skip the random draws of their default initialisation (``nn.Linear``'s
    ``reset_parameters``; the parameters hold what ``torch.empty`` gave them until then, and torch's global generator
    is left where it was: initialisation draws from generators of its own), and Python's cyclic garbage collector
    waits until the end (every object made is kept by the model: a collection would find nothing). Both together
    were ~75% of building DeepSeek-V3's ~15k expert modules on the meta device. The draws are skipped in this thread
    only."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with _SkippedDefaultInit():
            yield
    finally:
        if collecting:
            gc.enable()


def initialize_buffers(root: nn.Module, device: Optional[torch.device | str], *, only_meta: bool = True) -> None:
    """Modules that define ``initialize_buffers()`` (e.g. a router's expert bias, a persistent state that starts at
    zero) get their own buffers allocated on ``device`` and filled by it: those still on the meta device, or all of
    them with ``only_meta=False`` (after ``to_empty``, which leaves them uninitialised)."""
    for module in root.modules():
        fill = getattr(module, "initialize_buffers", None)
        own = list(module.buffers(recurse=False))
        if fill is None or not own or (only_meta and not any(b.is_meta for b in own)):
            continue
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:  # its own buffers only (to_empty would also empty the parameters)
                module._buffers[name] = torch.empty_like(buffer, device=device)
        with torch.no_grad():
            fill()


def _materialise(param: Tensor, values: Tensor, device: Optional[torch.device | str]) -> nn.Parameter:
    """A meta parameter's replacement holding ``values`` (on ``device``, our tags carried over), or a real one
    overwritten in place."""
    if not param.is_meta:
        with torch.no_grad():
            param.copy_(values)
        return param
    new = nn.Parameter(values.to(device=device, dtype=param.dtype), requires_grad=param.requires_grad)
    for tag in PARAMETER_TAGS:
        if hasattr(param, tag):
            setattr(new, tag, getattr(param, tag))
    return new


def initialize_parameters(
    root: nn.Module, seed: int, device: Optional[torch.device | str] = None, *, only_meta: bool = False
) -> None:
    """Give every parameter of ``root`` its layout-invariant initial value (see the module docstring).

    ``only_meta=True`` materialises meta parameters and leaves real ones (e.g. loaded weights) alone.
    """
    done: dict[int, nn.Parameter] = {}
    plans: list[tuple[str, nn.Module, Initializer]] = [
        (prefix, owner, owner.initialize_parameter) for prefix, owner in initializer_owners(root)
    ]
    plans.append(("", root, default_initializer))
    jobs: list[tuple[Tensor, str, Initializer]] = []  # (parameter, global name, its initialiser)
    for prefix, owner, initializer in plans:
        for module_name, module in owner.named_modules(remove_duplicate=False):
            for param_name, param in list(module.named_parameters(recurse=False)):
                if id(param) in done:
                    continue
                done[id(param)] = param
                if only_meta and not param.is_meta:
                    continue
                name = f"{module_name}.{param_name}" if module_name else param_name
                jobs.append((param, original_name(param, name), rule_for(module, initializer)))
    # Each draw is one sequential generator; several run at once on the host's threads (normal_ releases the GIL),
    # unless a dispatch mode is active: modes are per thread, and the draws must run under it (the fake tensors of
    # ``lightning-megatron simulate``, a memory probe).
    draw = lambda job: local_initial_values(job[0], job[1], seed, job[2])  # noqa: E731
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        drawn = map(draw, jobs) if _get_current_dispatch_mode_stack() else pool.map(draw, jobs)
        replaced = {id(param): _materialise(param, values, device) for (param, _, _), values in zip(jobs, drawn)}
    for module in root.modules():  # every name of a parameter (tied ones too) gets its replacement
        for param_name, param in list(module._parameters.items()):
            if param is not None and replaced.get(id(param), param) is not param:
                setattr(module, param_name, replaced[id(param)])
    initialize_buffers(root, device)
    meta_buffers = [name for name, buffer in root.named_buffers() if buffer.is_meta]
    if meta_buffers:
        raise RuntimeError(
            f"Buffers {meta_buffers} are still on the meta device after initialisation. Create buffers outside the "
            f"meta context (for example in forward) or register them with persistent=False and fill them in setup."
        )
