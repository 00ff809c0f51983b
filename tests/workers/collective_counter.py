"""Counting the collectives a piece of code issues, by kind and by the layout's name of the group.

``with CollectiveCounter(names) as calls: ...`` replaces the ``torch.distributed`` functions for the block and
counts each call as ``"<kind>/<group name>"`` (``world`` for the default group, ``other`` for an unnamed one);
``batch_isend_irecv`` counts one ``send`` or ``recv`` per tensor (``isend`` / ``irecv`` themselves stay: P2POp
accepts only the originals). ``names``: ``(name, group)`` pairs; where groups coincide the last name wins.
"""

from collections import Counter

import torch.distributed as dist

KINDS = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
         "reduce_scatter_single", "all_gather", "send", "recv", "broadcast", "batch_isend_irecv")


class CollectiveCounter(Counter):
    def __init__(self, names) -> None:
        super().__init__()
        self.names = {id(group): name for name, group in names if group is not None}
        self.originals: dict = {}

    def _name(self, group) -> str:
        return self.names.get(id(group), "world" if group is None else "other")

    def __enter__(self) -> "CollectiveCounter":
        for kind in KINDS:
            if hasattr(dist, kind):
                self.originals[kind] = original = getattr(dist, kind)

                def counted(*args, _kind=kind, _original=original, **kwargs):
                    if _kind == "batch_isend_irecv":
                        for op in args[0]:
                            self[f"{'send' if op.op is dist.isend else 'recv'}/{self._name(op.group)}"] += 1
                    else:
                        self[f"{_kind}/{self._name(kwargs.get('group'))}"] += 1
                    return _original(*args, **kwargs)
                setattr(dist, kind, counted)
        return self

    def __exit__(self, *exc) -> None:
        for kind, original in self.originals.items():
            setattr(dist, kind, original)

    def take(self) -> dict:
        """The counts so far, then start again from zero."""
        counts = dict(self)
        self.clear()
        return counts
