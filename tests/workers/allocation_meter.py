"""Bytes of tensor data a piece of code allocates, seen through torch's dispatcher (works on the CPU, where torch
keeps no allocator statistics)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class AllocationMeter(TorchDispatchMode):
    """``with AllocationMeter() as meter: ...``: ``meter.bytes`` sums the floating-point storages that the ops run
    inside create (not views of, or writes into, their inputs; pickled objects, byte tensors, are not counted).
    A sum, not a peak: an upper bound of what was held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage(t) for t in tree_flatten((args, kwargs))[0]}
        for tensor in tree_flatten(out)[0]:
            pointer = storage(tensor)
            if pointer is not None and pointer not in inputs and tensor.is_floating_point():
                inputs.add(pointer)
                self.bytes += tensor.untyped_storage().nbytes()
        return out


def storage(tensor):
    """The data pointer of a tensor's storage (``None`` for anything else: a DTensor has none of its own, a meta
    tensor no data)."""
    if not isinstance(tensor, torch.Tensor) or is_traceable_wrapper_subclass(tensor) or tensor.is_meta:
        return None
    return tensor.untyped_storage().data_ptr()
