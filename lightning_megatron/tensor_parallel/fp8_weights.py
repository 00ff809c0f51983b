"""A layer's weight cast to FP8 once per optimizer step, not once per GEMM.

An FP8 layer multiplies by its weight twice per micro-batch (forward and input gradient, each wanting it in its own
layout; rowwise scaling casts it along each of its two dimensions), a step runs many micro-batches, pipeline
schedules keep several in flight and activation recomputation runs each forward twice: the weight is the same every
time, so its amax, the all-reduce of that amax over the tensor-parallel group and its cast are done once and kept
here until the weight changes. That holds 2 bytes per weight element (the two layouts) from a step's first forward
to the next optimizer step, which frees them before it runs (its own temporaries peak then). What makes it exact is
knowing when the weight changes:

* **an optimizer step**: every ``torch.optim.Optimizer.step`` (the user's optimizer, stepped on the parameters
  or on fp32 main copies whose values are written back afterwards) runs a global pre-step hook that empties every
  cache (:func:`clear_fp8_weight_caches`), on every rank alike; the next use casts the new values;
* **an in-place write** outside an optimizer (``copy_`` into the parameter, ``load_state_dict``): it bumps the
  parameter's version counter, which an entry records;
* **a new tensor** (``param.data = other``, a module given another parameter): the entry records the memory it
  was cast from (:class:`Fp8WeightCache`).

What none of the three sees is a write that bypasses the version counter without an optimizer step: one through
``param.data`` (``param.detach()`` shares the counter, ``param.data`` does not), or FSDP2 re-gathering a parameter
after its shards were overwritten (it copies into the gathered parameter with the counter preserved). Whoever writes
weights that way calls :func:`clear_fp8_weight_caches` after. ZeRO-3 (FSDP2) does not cache
(``fp8_plan.convert_to_fp8``), for memory: it frees a layer's gathered weight after each use to hold 16 Psi / N
bytes, and the FP8 casts of every layer kept through the step would hold 2 Psi more; it casts after each all-gather,
as it gathers. The cache would be exact there too: within a step every gather brings the same values, and the
optimizer step empties it.

Every rank decides alike whether an entry is valid (the same calls fill it, the same steps empty it), so the
amax collectives, issued only on a miss, match across the group. Not used while ``torch.compile`` traces (the
compiled graph casts each time, which it fuses) nor under ``torch.inference_mode`` (its tensors cannot be kept for
training, nor the counter of an inference parameter read).
"""

from __future__ import annotations

import weakref
from typing import Generic, Optional, TypeVar

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

T = TypeVar("T")

_caches: "weakref.WeakSet[Fp8WeightCache]" = weakref.WeakSet()
_step_hook = None  # the optimizer pre-step hook's handle, once registered


def clear_fp8_weight_caches() -> None:
    """Forget every cached FP8 weight: the next GEMM casts from the weight as it is then. Runs before every optimizer
    step by itself; call it after writing weights in a way the version counter does not see (module docstring)."""
    for cache in list(_caches):
        cache.clear()


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    clear_fp8_weight_caches()


def _watch_optimizer_steps() -> None:
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_before_optimizer_step)


def caching_allowed(weight: Tensor) -> bool:
    """Whether a cast of ``weight`` may be kept now (module docstring)."""
    return not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or weight.is_inference())


class Fp8WeightCache(Generic[T]):
    """One layer's weight in FP8, one entry per GEMM that takes it (``key``), valid until the weight changes
    (module docstring). An entry knows its weight by its storage, not its Python object: backward gets the weight back
    from autograd's saved tensors, under activation recomputation as another tensor object over the same storage
    (sharing the parameter's version counter). The entry holds that storage, so no other tensor can be given the
    same storage while the entry lives."""

    def __init__(self) -> None:
        self._entries: dict[object, tuple[tuple, int, T]] = {}

    @staticmethod
    def _memory(weight: Tensor) -> tuple:
        storage = weight.untyped_storage()
        return storage, storage._cdata, weight.storage_offset(), tuple(weight.shape), weight.stride(), weight.dtype

    @staticmethod
    def _same(memory: tuple, weight: Tensor) -> bool:
        """The same storage (its identity, not its address), offset, shape, stride and dtype. Not the address: FSDP2
        frees a gathered weight's memory after use and gathers it again into the same storage, at an address the
        allocator picks, which may equal the old one on one rank and not on another; a hit on some ranks of a
        tensor-parallel group and a miss on others would issue different amax all-reduces, and hang."""
        _, identity, offset, shape, stride, dtype = memory
        return (identity == weight.untyped_storage()._cdata and offset == weight.storage_offset()
                and shape == tuple(weight.shape) and stride == weight.stride() and dtype == weight.dtype)

    def lookup(self, weight: Tensor, key: object) -> Optional[T]:
        """The cached cast of ``weight`` for ``key`` if it is still the weight's, else None."""
        if not caching_allowed(weight):
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        memory, version, value = entry
        if version == weight._version and self._same(memory, weight):
            return value
        del self._entries[key]  # the weight changed: its old cast is memory nobody will read
        return None

    def store(self, weight: Tensor, key: object, value: T) -> T:
        """Keep ``value``, the cast of ``weight`` for ``key`` (where caching is allowed); returns it."""
        if caching_allowed(weight):
            _watch_optimizer_steps()
            _caches.add(self)
            self._entries[key] = (self._memory(weight), weight._version, value)
        return value

    def clear(self) -> None:
        self._entries.clear()
