"""What a simulated rank's step did: the collectives it issued, per group, and its memory by category at its peak.

* :class:`CollectiveLog` sees every collective op (``c10d``'s and the functional ones) as it is dispatched and
  notes its kind, its group (named after the layout's groups: ``tp``, ``dp``, ``pp``, ...) and the bytes of its
  buffer: the whole tensor for an all-reduce, a broadcast, a send or a receive; the gathered output of an
  all-gather; the input of a reduce-scatter or an all-to-all.
* :func:`peak_by_category` reads ``plan.probes.LiveStorages``' log of every storage allocated while the simulation
  ran (the model's materialisation included, so everything the rank holds is in it) and splits the bytes alive at
  the peak of a stretch of it into parameters, gradients, main parameters, optimizer state and the rest
  (activations and temporaries).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.plan.probes import LiveStorages

# The collective ops' names (c10d's and the functional ones) -> the kind reported.
_KINDS = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "alltoall_": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast", "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "barrier": "barrier", "allreduce_coalesced_": "all_reduce", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter",
}
# Kinds whose buffer is the output (the gathered tensor), not the input.
_OUTPUT_SIZED = {"all_gather"}
_WAITS = {"wait_tensor"}


def group_names(state: ParallelState) -> dict[str, str]:
    """The layout's groups by torch's ``group_name``: ``tp``, ``cp``, ``dp``, ``pp`` (the mesh's), ``dp x cp`` (the
    replicas'), ``model parallel``, ``embedding``, ``ep``, ``expert dp``, and ``tp subgroup of N``."""
    names: dict[str, str] = {}

    def add(group, name: str) -> None:
        if group is not None and group.group_name not in names:
            names[group.group_name] = name

    if state.mesh is not None:
        for dim in state.mesh.mesh_dim_names:
            add(state.mesh.get_group(dim), dim)
    if state.replica_mesh is not None:
        add(state.replica_mesh.get_group(), "dp x cp")
    add(state.model_parallel_group, "model parallel")
    add(state.embedding_group, "embedding")
    add(state.expert_parallel_group, "ep")
    add(state.expert_data_parallel_group, "expert dp")
    add(dist.group.WORLD, "world")
    return names


@dataclass
class CollectiveTotals:
    count: int = 0
    bytes: int = 0


@dataclass
class CollectiveLog(TorchDispatchMode):
    """Counts each collective op and its buffer's bytes by (kind, group name); see the module docstring."""

    names: dict[str, str] = field(default_factory=dict)
    totals: dict[tuple[str, str], CollectiveTotals] = field(default_factory=lambda: defaultdict(CollectiveTotals))

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = _KINDS.get(func._schema.name.split("::")[-1])
            if kind is not None:
                key = (kind, self._group_of(args, kwargs))
                totals = self.totals[key]
                totals.count += 1
                totals.bytes += self._buffer_bytes(kind, args, func.namespace == "c10d")
        return func(*args, **kwargs)

    def _group_of(self, args, kwargs) -> str:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.ScriptObject):
                name = dist.ProcessGroup.unbox(value).group_name
                return self.names.get(name, f"group {name}")
            if isinstance(value, str) and value in self.names:  # the functional collectives name their group
                return self.names[value]
        return "?"

    @staticmethod
    def _buffer_bytes(kind: str, args, c10d: bool) -> int:
        if kind == "reduce_scatter" and c10d:
            args = args[1:]  # c10d's reduce-scatters take (output, input): the input is the buffer
        tensors = [t for t in tree_flatten(args[:2] if kind in _OUTPUT_SIZED else args[:1])[0] if isinstance(t, Tensor)]
        if not tensors:
            return 0
        if kind in _OUTPUT_SIZED:
            tensors = tensors[:1]  # c10d's all-gather: (output, input); functional: input x group size
        return sum(t.numel() * t.element_size() for t in tensors)

    def rows(self) -> list[dict]:
        return [{"kind": kind, "group": group, "count": totals.count, "bytes": totals.bytes}
                for (kind, group), totals in sorted(self.totals.items(), key=lambda item: (item[0][1], item[0][0]))]


def peak_by_category(live: LiveStorages, categories: dict[str, Iterable[Tensor]], *, start: int = 0
                     ) -> tuple[int, dict[str, int]]:
    """The most bytes alive at once over ``live.events[start:]`` (counting what was alive at ``start``), and how
    they split among ``categories`` (each a set of tensors whose storages belong to it; the first category that
    names a storage takes it) and ``"activations and temporaries"`` (everything else)."""
    owner: dict[int, str] = {}
    for name, tensors in categories.items():
        for index in live.ids_of([t for t in tensors if t is not None]):
            owner.setdefault(index, name)
    alive: Counter = Counter()
    for delta, index in live.events[:start]:
        alive[index] += delta
    current = sum(alive.values())
    peak, peak_at = current, start
    for position in range(start, len(live.events)):
        current += live.events[position][0]
        if current > peak:
            peak, peak_at = current, position + 1
    for delta, index in live.events[start:peak_at]:
        alive[index] += delta
    split = Counter({name: 0 for name in categories})
    for index, nbytes in alive.items():
        split[owner.get(index, "activations and temporaries")] += nbytes
    return peak, dict(split)
