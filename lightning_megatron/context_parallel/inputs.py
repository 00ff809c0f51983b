"""What a model tells the strategy about its batches' sequence dimension, and how context parallelism cuts them.

Under ``context_parallel_size = n`` every sample's sequence of ``S`` tokens is cut into ``2n`` chunks and
rank ``i`` keeps chunks ``i`` and ``2n - 1 - i`` (Megatron-Core's load balancing for causal attention: the
early chunk sees few keys, the late one many, so every rank does the same attention work). Its tokens
are then ``S / n`` positions in increasing order, and their global positions go to the model as
``position_ids``, so learned and rotary positions both follow the chunks. Labels are cut the same way:
each rank's loss is a sum over its own tokens, and the token counts add up over ``dp x cp``.

The model declares which entries of its batch dictionary carry the sequence (:class:`SequenceInputs`):
entries cut into the rank's chunks (tokens, labels, token types, positions), and per-key masks (key padding,
the document ids of packed samples), kept whole but reordered into the ring's order (rank 0's chunks, then
rank 1's, ...), since each rank's attention reads them for every rank's keys. Any other entry of shape
``[B, S, ...]`` is refused by name: cutting it wrongly would change the model silently.

Nothing here communicates: every context-parallel rank receives the same samples (the sampler splits
over dp only) and cuts its own part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class SequenceInputs:
    """The entries of a model's batch dictionary that have a sequence dimension (dim 1).

    ``split``: cut into this rank's chunks (the first must be in every batch, e.g. the tokens). ``key_masks``:
    ``[B, S]`` masks over the keys (key padding, document ids), kept whole in the ring's order. ``positions``: the
    entry the global positions of the rank's tokens go to (cut if the batch has it, e.g. positions that restart
    at each document; made from ``arange(S)`` otherwise). ``max_length``: the longest whole sequence the model
    takes (its own check sees only a rank's part).
    """

    split: tuple[str, ...]
    key_masks: tuple[str, ...] = ()
    positions: str = "position_ids"
    max_length: Optional[int] = None


def chunk_indices(seq_length: int, size: int, rank: int, device=None) -> Tensor:
    """The global positions rank ``rank`` of ``size`` holds: chunks ``rank`` and ``2 * size - 1 - rank`` of
    ``2 * size`` equal chunks, in increasing order."""
    chunk = seq_length // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, second])


def ring_order(seq_length: int, size: int, device=None) -> Tensor:
    """Every rank's positions, rank after rank: the order of keys gathered over the context-parallel group."""
    return torch.cat([chunk_indices(seq_length, size, rank, device) for rank in range(size)])


def check_sequence_length(seq_length: int, size: int, *, tensor_parallel_size: int = 1,
                          sequence_parallel: bool = False) -> None:
    """Raise (the same on every rank: they all see the same batch shape) if the sequence cannot be cut."""
    multiple = 2 * size * (tensor_parallel_size if sequence_parallel else 1)
    if seq_length % multiple:
        why = (f"2 * context_parallel_size = {2 * size} chunks (Megatron's causal load balancing)"
               + (f", each rank's share then split over tensor_parallel_size={tensor_parallel_size} by sequence "
                  f"parallelism" if sequence_parallel and tensor_parallel_size > 1 else ""))
        lower, upper = seq_length - seq_length % multiple, seq_length + multiple - seq_length % multiple
        raise ValueError(
            f"Context parallelism cuts each sequence into {why}, so the sequence length must be a multiple of "
            f"{multiple}; it is {seq_length}. Use seq_length={lower or upper} or {upper} (the data module's "
            f"seq_length), or another context_parallel_size.")


def split_batch(batch: Mapping[str, object], inputs: SequenceInputs, size: int, rank: int, *,
                tensor_parallel_size: int = 1, sequence_parallel: bool = False, model_name: str = "the model"
                ) -> dict[str, object]:
    """This rank's part of ``batch`` (see the module docstring); other entries (per-sample labels) pass whole."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"Context parallelism cuts dictionary batches by the names {model_name}.sequence_inputs() "
                        f"declares; this batch is a {type(batch).__name__}.")
    if not inputs.split or inputs.split[0] not in batch:  # the others are optional (BERT's token types)
        raise ValueError(f"{model_name}.sequence_inputs() names {inputs.split[:1] or 'no'} as the first entry to "
                         f"split, which the batch (keys {sorted(batch)}) does not have.")
    reference = batch[inputs.split[0]]
    seq_length = reference.shape[1]
    declared = {*inputs.split, *inputs.key_masks, inputs.positions}
    for name, value in batch.items():
        if (isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == seq_length
                and value.shape[0] == reference.shape[0] and name not in declared):
            raise ValueError(
                f"The batch entry {name!r} (shape {list(value.shape)}) has the sequence dimension, but "
                f"{model_name}.sequence_inputs() does not say how context parallelism cuts it (split: "
                f"{list(inputs.split)}, key masks: {list(inputs.key_masks)}). Declare it there, or leave it out.")
    if inputs.max_length is not None and seq_length > inputs.max_length:
        raise ValueError(f"Sequence length {seq_length} exceeds max_seq_length={inputs.max_length} of {model_name}.")
    check_sequence_length(seq_length, size, tensor_parallel_size=tensor_parallel_size,
                          sequence_parallel=sequence_parallel)
    mine = chunk_indices(seq_length, size, rank, reference.device)
    out = dict(batch)
    for name in dict.fromkeys((*inputs.split, inputs.positions)):
        if batch.get(name) is not None:
            out[name] = batch[name][:, mine]
    if batch.get(inputs.positions) is None:
        out[inputs.positions] = mine.expand(reference.shape[0], -1)
    order = ring_order(seq_length, size, reference.device)
    for name in inputs.key_masks:
        if batch.get(name) is not None:
            out[name] = batch[name][:, order]
    return out
