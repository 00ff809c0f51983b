"""What a simulated rank's step did: the collectives it issued, per group, and its memory by category at its peak.

* :class:`CollectiveLog` sees every collective op (``c10d``'s and the functional ones) as it is dispatched and
  notes its kind, its group (named after the layout's groups: ``tp``, ``dp``, ``pp``, ...) and the bytes of its
  buffer: the whole tensor for an all-reduce, a broadcast, a send or a receive; the gathered output of an
  all-gather; the input of a reduce-scatter or an all-to-all.
* :func:`peak_by_category` reads ``plan.probes.LiveStorages``' log of every storage allocated while the simulation
  ran (the model's materialisation included, so everything the rank holds is in it) and splits the bytes alive at
  the peak of a stretch of it into parameters, gradients, main parameters, optimizer state, activations (what
  autograd saved for backward, :class:`SavedForBackward`) and temporaries (the rest).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.plan.probes import LiveStorages
from lightning_megatron.simulate.fake_world import COLLECTIVE_NAMESPACES, KnownValues

# The collective ops (c10d's and the functional ones) -> (the kind reported, which argument is the whole buffer, and
# whether that argument is one rank's part of it: the functional all-gather's input, times the group's size).
_OPS = {
    "allreduce_": ("all_reduce", 0, False), "allreduce_coalesced_": ("all_reduce", 0, False),
    "all_reduce": ("all_reduce", 0, False), "all_reduce_": ("all_reduce", 0, False),
    "_allgather_base_": ("all_gather", 0, False), "allgather_": ("all_gather", 0, False),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True), "all_gather_into_tensor_coalesced": ("all_gather", 0, True),
    "_reduce_scatter_base_": ("reduce_scatter", 1, False), "reduce_scatter_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, False),
    "alltoall_base_": ("all_to_all", 1, False), "alltoall_": ("all_to_all", 1, False),
    "all_to_all_single": ("all_to_all", 0, False),
    "broadcast_": ("broadcast", 0, False), "broadcast": ("broadcast", 0, False), "send": ("send", 0, False),
    "recv_": ("recv", 0, False), "recv_any_source_": ("recv", 0, False), "reduce_": ("reduce", 0, False),
    "gather_": ("gather", 1, False), "scatter_": ("scatter", 1, False), "barrier": ("barrier", 0, False),
}


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
class CollectiveLog:
    """Counts each collective op and its buffer's bytes by (kind, group name); see the module docstring."""

    names: dict[str, str] = field(default_factory=dict)
    totals: dict[tuple[str, str], CollectiveTotals] = field(default_factory=lambda: defaultdict(CollectiveTotals))

    def note(self, func, args, kwargs) -> None:
        """Count ``func`` if it is a collective."""
        if func.namespace in COLLECTIVE_NAMESPACES:
            known = _OPS.get(func._schema.name.split("::")[-1])
            if known is not None:
                kind, index, per_rank = known
                totals = self.totals[(kind, self._group_of(args, kwargs))]
                totals.count += 1
                tensors = [t for t in tree_flatten(args[index])[0] if isinstance(t, Tensor)] if len(args) > index else []
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                totals.bytes += nbytes * (args[1] if per_rank else 1)  # the functional ops' group size

    def _group_of(self, args, kwargs) -> str:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.ScriptObject):
                name = dist.ProcessGroup.unbox(value).group_name
                return self.names.get(name, f"group {name}")
            if isinstance(value, str) and value in self.names:  # the functional collectives name their group
                return self.names[value]
        return "?"

    def rows(self) -> list[dict]:
        return [{"kind": kind, "group": group, "count": totals.count, "bytes": totals.bytes}
                for (kind, group), totals in sorted(self.totals.items(), key=lambda item: (item[0][1], item[0][0]))]


class SavedForBackward:
    """While active, notes which of ``live``'s storages autograd saves for backward: at the peak, those are the
    activations, the rest of what is not model state the temporaries (``saved_tensors_hooks``; a recomputed
    layer's own hooks take over inside it, and it saves nothing until its backward)."""

    def __init__(self, live: LiveStorages) -> None:
        self.live, self.ids = live, set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: Tensor) -> Tensor:
        self.ids |= self.live.ids_of([tensor])
        return tensor

    def __enter__(self) -> "SavedForBackward":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def peak_by_category(live: LiveStorages, categories: dict[str, Iterable[Tensor]], *, saved: set[int] = frozenset(),
                     start: int = 0) -> tuple[int, dict[str, int], dict[str, int]]:
    """The most bytes alive at once over ``live.events[start:]`` (counting what was alive at ``start``), and how
    they split among ``categories`` (each a set of tensors whose storages belong to it; the first category that
    names a storage takes it), ``"activations"`` (the ``saved`` storages: autograd keeps them for backward) and
    ``"temporaries"`` (everything else); the five largest parts of the last two at the peak, named by the op that
    allocated them."""
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
    split = Counter({name: 0 for name in (*categories, "activations", "temporaries")})
    largest: Counter = Counter()  # activations and temporaries by the op that allocated them ("aten.mm.default (fw)")
    for index, nbytes in alive.items():
        category = owner.get(index) or ("activations" if index in saved else "temporaries")
        split[category] += nbytes
        if category not in categories and nbytes:
            largest[live.names[index]] += nbytes
    return peak, dict(split), dict(largest.most_common(5))


class Observed(TorchDispatchMode):
    """One dispatch mode running the simulation's three observers on every op (three modes would dispatch each op
    three times more): the collectives counted, the op run by ``values`` (``fake_world.KnownValues``, which answers
    host reads and keeps small values), the storages it allocated logged."""

    def __init__(self, values: KnownValues, log: CollectiveLog, live: LiveStorages) -> None:
        super().__init__()
        self.values, self.log, self.live = values, log, live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.log.note(func, args, kwargs)
        in_backward = torch._C._current_graph_task_id() != -1
        out = self.values.run(func, args, kwargs)
        self.live.observe(func, args, kwargs, out, in_backward)
        return out

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.live.stop()
