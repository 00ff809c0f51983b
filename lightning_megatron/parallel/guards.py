"""Two checks any run can switch on around its steps, for the mistakes a CPU run with gloo hides and a GPU run pays for.

- :func:`check_collective_devices`: every tensor handed to a collective is on the run's device. NCCL refuses a CPU
  tensor (or, worse, a tensor of another GPU) only when the collective runs; gloo takes anything. The check sits at
  the dispatcher (a ``TorchDispatchMode``), below every Python spelling of a collective: ``torch.distributed``'s
  functions (``all_reduce`` ... ``isend``/``irecv``, the P2P ops of ``batch_isend_irecv``, the object collectives),
  its functional collectives (``_c10d_functional``: DTensor redistribution and compiled code) and FSDP2's
  all-gathers and reduce-scatters all reach the same ``c10d`` / ``_c10d_functional`` operators. Only ``barrier``
  goes unchecked: its tensor is c10d's own.
- :func:`count_host_syncs`: how many calls force the device to finish its queued work and hand a value to the
  host, by kind and by call site. One per step is harmless; one per layer, micro-batch or expert stalls the GPU's
  queue that many times a step. A ``TorchFunctionMode`` sees the Python-level call (``x.item()``, ``bool(x)``),
  which the dispatcher alone cannot (``x.cpu()`` of a CPU tensor dispatches nothing).

Counted kinds (:data:`SYNC_KINDS`), each because on CUDA it blocks the host until the tensor's value exists:
``item``, ``tolist``, ``bool``, ``int`` (``int(x)``, ``x.__index__()``, as ``range(x)`` or a shape take it),
``float``, ``numpy`` (``x.numpy()``, ``np.asarray(x)``), ``print`` (``repr``/``str``/``format`` read the values),
``compare`` (``torch.equal``, ``torch.allclose``, ``torch.is_nonzero``: a Python bool), ``to_host`` (``x.cpu()``;
``x.to(...)`` or ``dst.copy_(x)`` that moves the values from a device to the host without ``non_blocking``),
``dynamic_shape`` (output shapes that depend on values: ``nonzero``, ``argwhere``, ``unique``,
``unique_consecutive``, ``masked_select``, one-argument ``torch.where``, ``repeat_interleave`` with tensor repeats
and no ``output_size``, ``bincount``, and indexing or assigning with a boolean mask), and ``synchronize``
(``torch.cuda.synchronize``, ``torch.accelerator.synchronize``, a CUDA event's or stream's ``synchronize``).
Not counted: ``x.to(device)`` onto a device (a host-to-device copy does not wait for the device), non-blocking
copies, and calls in other threads than the one that entered the block (a mode is thread-local; the autograd engine
carries it into backward).

On CPU every tensor is a host tensor, so ``count_host_syncs()`` counts every call of the kinds above: exactly what a
CUDA run does when those tensors live on the GPU. Two exceptions: ``to_host`` there counts only explicit ``.cpu()``
calls (a ``.to(device)`` onto the CPU cannot be told from a move onto a GPU), and ``torch.optim``'s own reads are left
out (its step counters stay on the host on a GPU too unless the optimizer is capturable or fused, and then it reads
none). On a GPU, pass ``device`` to count only the calls on that device's tensors (a CPU scalar's ``.item()`` costs
nothing there), torch.optim's included.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from typing import Iterator, Optional, Union

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS_FILE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_TORCH_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep
#: torch's wrappers between a tensor method's caller and the mode (``Tensor.__format__`` and the like).
_TORCH_WRAPPERS = tuple(os.path.join(_TORCH_DIR, name) for name in ("_tensor.py", "overrides.py"))


def call_site(skip: int = 2) -> str:
    """``file:line`` of the innermost frame inside ``lightning_megatron`` (this module aside), relative to the
    package's parent; else of the innermost frame outside torch (a test, Lightning); else ``"?"``."""
    frame, fallback = sys._getframe(skip), None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _THIS_FILE:
            if path.startswith(_PACKAGE_DIR + os.sep):
                return f"{os.path.relpath(path, os.path.dirname(_PACKAGE_DIR))}:{frame.f_lineno}"
            if fallback is None and not path.startswith(_TORCH_DIR + os.sep):
                fallback = f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"


def _same_device(tensor_device: torch.device, expected: torch.device) -> bool:
    return tensor_device.type == expected.type and (expected.index is None or tensor_device.index == expected.index)


def _resolved(device: Union[str, torch.device]) -> torch.device:
    """``device`` with the current index filled in for an accelerator named without one (``"cuda"``)."""
    device = torch.device(device)
    if device.type not in ("cpu", "meta") and device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    return device


# ---------------------------------------------------------------------------------------------- collective devices
#: The operator namespaces every collective reaches, whichever Python API issued it.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
#: c10d operators whose tensors are c10d's own, not the caller's.
_UNCHECKED = ("barrier", "monitored_barrier")
#: The torch.distributed name of each c10d operator, for the error message.
_PUBLIC_NAMES = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce_coalesced",
                 "_allgather_base_": "all_gather_into_tensor", "allgather_": "all_gather",
                 "allgather_into_tensor_coalesced_": "all_gather_into_tensor (coalesced)",
                 "_reduce_scatter_base_": "reduce_scatter_tensor", "reduce_scatter_": "reduce_scatter",
                 "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor (coalesced)", "broadcast_": "broadcast",
                 "reduce_": "reduce", "alltoall_base_": "all_to_all_single", "alltoall_": "all_to_all",
                 "send": "send/isend", "recv_": "recv/irecv", "recv_any_source_": "recv", "gather_": "gather",
                 "scatter_": "scatter"}


class _CollectiveDeviceCheck(TorchDispatchMode):
    def __init__(self, device: torch.device, checked: Counter) -> None:
        super().__init__()
        self.device, self.checked = device, checked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES and func._opname not in _UNCHECKED:
            public = _PUBLIC_NAMES.get(func._opname, func._opname)
            self.checked[public] += 1
            for tensor in tree_leaves((args, kwargs)):
                if isinstance(tensor, torch.Tensor) and not _same_device(tensor.device, self.device):
                    raise RuntimeError(
                        f"collective {public} ({func.namespace}.{func._opname}) was handed a tensor on "
                        f"{tensor.device} of shape {list(tensor.shape)} ({tensor.dtype}) at {call_site()}, but this "
                        f"run's device is {self.device}: NCCL fails (or reads another GPU's memory) there. Move the "
                        f"tensor to the run's device (e.g. torch.tensor(..., device=device)) before the collective.")
        return func(*args, **kwargs)


@contextlib.contextmanager
def check_collective_devices(device: Union[str, torch.device]) -> Iterator[Counter]:
    """Raise a ``RuntimeError`` naming the collective, the tensor's device and shape, the call site and ``device``
    whenever a collective inside the block is handed a tensor that is not on ``device``. Yields a ``Counter`` of the
    collectives checked, by ``torch.distributed`` name (proof that the check saw them).

    Example::

        with check_collective_devices(trainer.strategy.root_device) as checked:
            trainer.fit(model, datamodule=data)
    """
    checked: Counter = Counter()
    with _CollectiveDeviceCheck(_resolved(device), checked):
        yield checked


# ---------------------------------------------------------------------------------------------- host syncs
SYNC_KINDS = ("item", "tolist", "bool", "int", "float", "numpy", "print", "compare", "to_host", "dynamic_shape",
              "synchronize")

_T = torch.Tensor
# Calls that read a tensor's values on the host: the kind each is counted as. The tensor read is the first argument.
_READS = {_T.item: "item", _T.tolist: "tolist", _T.__bool__: "bool", _T.__int__: "int", _T.__index__: "int",
          _T.__float__: "float", _T.numpy: "numpy", _T.__array__: "numpy", _T.__repr__: "print",
          _T.__str__: "print", _T.__format__: "print", torch.equal: "compare", _T.equal: "compare",
          torch.allclose: "compare", _T.allclose: "compare", torch.is_nonzero: "compare", _T.is_nonzero: "compare",
          _T.cpu: "to_host", torch.nonzero: "dynamic_shape", _T.nonzero: "dynamic_shape",
          torch.argwhere: "dynamic_shape", _T.argwhere: "dynamic_shape", torch.unique: "dynamic_shape",
          _T.unique: "dynamic_shape", torch.unique_consecutive: "dynamic_shape",
          _T.unique_consecutive: "dynamic_shape", torch.masked_select: "dynamic_shape",
          _T.masked_select: "dynamic_shape", torch.bincount: "dynamic_shape", _T.bincount: "dynamic_shape"}


def _bool_mask(index) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(index))


def _target_device(args, kwargs) -> Optional[torch.device]:
    """Where ``Tensor.to(*args, **kwargs)`` sends the tensor, or None for a dtype-only conversion."""
    for value in (kwargs.get("device"), *args):
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, (str, torch.device, int)) and not isinstance(value, bool):
            return torch.device(value)
    return None


def _sync_kind(func, args, kwargs) -> tuple[Optional[str], Optional[torch.Tensor]]:
    """The kind of host sync ``func(*args, **kwargs)`` forces and the tensor whose values it waits for, or
    ``(None, None)`` for a call that forces none."""
    kind = _READS.get(func)
    if kind is not None:
        return kind, args[0] if args and isinstance(args[0], torch.Tensor) else None
    if func in (_T.__getitem__, _T.__setitem__) and len(args) > 1 and _bool_mask(args[1]):
        return "dynamic_shape", args[1] if isinstance(args[1], torch.Tensor) else args[0]
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "dynamic_shape", args[0] if args else kwargs.get("condition")
    if func in (torch.repeat_interleave, _T.repeat_interleave) and kwargs.get("output_size") is None:
        single = args[0] if func is torch.repeat_interleave else None  # torch.repeat_interleave(repeats)
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", single)
        if isinstance(repeats, torch.Tensor):
            return "dynamic_shape", repeats
    non_blocking = kwargs.get("non_blocking") or any(arg is True for arg in args[1:])
    if func is _T.to and args and not non_blocking:
        target = _target_device(args[1:], kwargs)
        if target is not None and target.type == "cpu" and args[0].device.type != "cpu":
            return "to_host", args[0]
    if func is _T.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor) and not non_blocking:
        if args[0].device.type == "cpu" and args[1].device.type != "cpu":
            return "to_host", args[1]
    return None, None


class HostSyncs:
    """What :func:`count_host_syncs` counted: ``total``, ``by_kind`` (kind -> calls) and ``sites`` (kind ->
    ``Counter`` of ``file:line``: the innermost frame inside ``lightning_megatron`` that made the call)."""

    def __init__(self) -> None:
        self.by_kind: Counter = Counter()
        self.sites: dict[str, Counter] = {}

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def add(self, kind: str, site: str) -> None:
        self.by_kind[kind] += 1
        self.sites.setdefault(kind, Counter())[site] += 1

    def reset(self) -> None:
        """Start again from zero (e.g. after the first step, which builds what later steps reuse)."""
        self.by_kind.clear()
        self.sites.clear()

    def report(self) -> str:
        """One line per kind and call site, most calls first."""
        rows = [(count, kind, site) for kind, sites in self.sites.items() for site, count in sites.items()]
        return "\n".join(f"{count:6d}  {kind:14s} {site}" for count, kind, site in sorted(rows, reverse=True))


def _called_by_torch_optim() -> bool:
    """Whether the code that made the call is ``torch.optim``'s: its step counters live on the host unless the
    optimizer is capturable or fused (then it reads none), so its reads never wait for a device."""
    frame = sys._getframe(2)
    while frame is not None and (os.path.abspath(frame.f_code.co_filename) == _THIS_FILE
                                 or os.path.abspath(frame.f_code.co_filename).startswith(_TORCH_WRAPPERS)):
        frame = frame.f_back
    return frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_TORCH_OPTIM_DIR)


class _HostSyncCounter(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs, device: Optional[torch.device]) -> None:
        super().__init__()
        self.syncs, self.device = syncs, device

    def _waits_for_device(self, tensor: Optional[torch.Tensor]) -> bool:
        if self.device is None:  # every tensor stands for a device tensor, but torch.optim's step counters
            return not _called_by_torch_optim()
        return tensor is None or _same_device(tensor.device, self.device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, tensor = _sync_kind(func, args, kwargs)
        if kind is not None and self._waits_for_device(tensor):
            self.syncs.add(kind, call_site())
        return func(*args, **kwargs)


def _synchronize_functions() -> list[tuple[object, str]]:
    """(owner, attribute) of every explicit device synchronisation this torch build has."""
    owners = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]
    if hasattr(torch, "accelerator"):
        owners.append((torch.accelerator, "synchronize"))
    return [(owner, name) for owner, name in owners if hasattr(owner, name)]


@contextlib.contextmanager
def count_host_syncs(device: Optional[Union[str, torch.device]] = None) -> Iterator[HostSyncs]:
    """Count the calls inside the block that make the host wait for the device (the kinds of :data:`SYNC_KINDS`),
    with the call site of each. ``device``: count only calls on that device's tensors (``None``: every tensor,
    as a CPU run needs). Explicit synchronisations are counted whatever ``device`` is.

    Example::

        with count_host_syncs() as syncs:
            trainer.fit(model, datamodule=data)
        assert syncs.total <= 4, syncs.report()
    """
    syncs = HostSyncs()
    originals = [(owner, name, getattr(owner, name)) for owner, name in _synchronize_functions()]

    def counted(original):
        def synchronize(*args, **kwargs):  # counted before it runs: a CPU build's CUDA functions raise
            syncs.add("synchronize", call_site())
            return original(*args, **kwargs)
        return synchronize

    for owner, name, original in originals:
        setattr(owner, name, counted(original))
    try:
        with _HostSyncCounter(syncs, None if device is None else _resolved(device)):
            yield syncs
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
