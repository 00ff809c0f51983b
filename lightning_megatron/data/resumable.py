"""Data loading that resumes mid-epoch from a checkpoint without repeating or skipping samples.

Lightning saves the ``state_dict()`` of any dataloader that has one with the fit loop's
state and hands it back through ``load_state_dict()`` before iterating again; it does not
skip data by itself. ``ResumableDataLoader`` counts the batches the loop has consumed in
the current epoch (in the main process, so prefetching workers do not inflate it) and, after
a restore, starts the sampler that many batches in. Because the data-parallel ranks' batches
interleave one global permutation, "k batches in" is the same set of samples at any
data-parallel size: a run may resume with another layout.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that starts the resumed epoch ``start_index`` samples in.

    Every pass over the resumed epoch skips them (Lightning may create an iterator more than
    once), until ``set_epoch`` moves to another epoch. Its length stays the epoch's: Lightning
    restores its batch counter to the resumed batch and ends the epoch when the shorter
    iterator runs out.
    """

    start_index = 0
    #: Set by a restore of an epoch that ended before this (rebuilt, longer) dataset does: the next epoch goes on
    #: from there. A dataset ordered over the whole run (``train_samples``) is rebuilt longer when ``max_steps``
    #: grows; its order over the first samples stays, so the resumed run must not read them again.
    carry_over: Optional[int] = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start_index = self.carry_over if self.carry_over is not None and epoch == self.epoch + 1 else 0
            self.carry_over = None
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        """``DistributedSampler``'s indices (``drop_last``: the tail that does not divide over the ranks is left
        out), from ``start_index`` on, without a Python list of the epoch: a corpus's millions of samples
        cost 8 bytes each when shuffled and nothing when not."""
        if not self.drop_last:
            return iter(list(super().__iter__())[self.start_index :])
        first, step = self.rank + self.start_index * self.num_replicas, self.num_replicas
        if not self.shuffle:
            return iter(range(first, self.total_size, step))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator)[first : self.total_size : step]
        return map(int, order.numpy())


class OrderedDistributedSampler(ResumableDistributedSampler, SequentialSampler):
    """The unshuffled sampler: it is a ``SequentialSampler`` too, so that Lightning's ``overfit_batches``, which
    replaces any other sampler by one that ignores dp, leaves it alone."""

    def __init__(self, dataset: Dataset, **kwargs: Any) -> None:
        super().__init__(dataset, shuffle=False, **kwargs)
        self.data_source = dataset


def data_parallel_sampler(dataset: Dataset, *, num_replicas: int, rank: int, shuffle: bool,
                          seed: int) -> ResumableDistributedSampler:
    """Rank ``rank``'s share of every global batch: every ``num_replicas``-th sample of the epoch's order (the
    dataset's own, or a seeded shuffle); a tail that does not divide over the ranks is dropped, never repeated."""
    if shuffle:
        return ResumableDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed,
                                           drop_last=True)
    return OrderedDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=True)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableDistributedSampler` that counts the batches consumed.

    ``trainer.predict`` rebuilds any loader it is given with a batch sampler of its own around the sampler (it
    records the indices and keeps a last partial batch); the rebuilt loader reads the same samples of this rank in
    the same order, and is not resumed (prediction saves no loader state), so that predicting over a data module's
    validation or test loader works as over any ``DataLoader``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resumable = isinstance(self.sampler, ResumableDistributedSampler)
        if not self.resumable and kwargs.get("batch_sampler") is None:
            raise TypeError(f"ResumableDataLoader needs a ResumableDistributedSampler as its sampler, got "
                            f"{type(self.sampler).__name__}.")
        self._consumed_batches = 0

    def __iter__(self) -> Iterator[Any]:
        if not self.resumable:
            yield from super().__iter__()
            return
        self._consumed_batches = self.sampler.start_index // self.batch_size
        for batch in super().__iter__():
            self._consumed_batches += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        if not self.resumable:
            return {}
        return {"epoch": self.sampler.epoch, "consumed_batches": self._consumed_batches, "epoch_batches": len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.set_epoch(state["epoch"])
        self.sampler.start_index = state["consumed_batches"] * self.batch_size
        ended = state["consumed_batches"] >= state.get("epoch_batches", float("inf"))
        if ended and not self.sampler.shuffle and self.sampler.start_index < self.sampler.num_samples:
            self.sampler.carry_over = self.sampler.start_index  # Lightning starts the next epoch: go on from here
