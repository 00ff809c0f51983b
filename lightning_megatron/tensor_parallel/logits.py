"""Vocab-parallel logits: which slice of the vocabulary a rank holds, marking them, and gathering them whole.

Under tensor parallelism the output layer (``VocabParallelHead``) gives each rank the logits of its
slice of the padded vocabulary, ``[..., V_padded / tp]``. Training never needs more: the vocab-parallel
cross-entropy, argmax and sampling reduce over the group one number per token. Code written for a
single GPU does need more, and goes wrong quietly: ``F.cross_entropy`` reads a label ``>= V/tp`` as out
of range (an index error at a real vocabulary; a silently wrong loss when the labels happen to fit),
and ``argmax`` picks a token of this rank's slice. So the head returns its logits as a
:class:`VocabParallelLogits` tensor, which behaves as an ordinary tensor except that, split over more
than one rank, the functions that need the whole vocabulary (cross-entropy, softmax, argmax, top-k)
refuse it with an error naming the fix; reshapes, dtype casts, indexing and scaling keep the mark,
everything else returns plain tensors. The head marks its logits at ``tensor_parallel_size=1`` too (the
whole, padded vocabulary; nothing is refused), so that :func:`gather_vocab_logits`, which returns the
full, unpadded logits on every rank of the group, works the same at every tensor-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from lightning_megatron.tensor_parallel.mappings import gather_from_tensor_parallel


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary: ids ``[start, start + size)`` are real, the rest of its
    ``local_width`` columns is padding; ``vocab_size``: the real vocabulary (padding excluded)."""

    group: Optional[dist.ProcessGroup]
    start: int
    size: int
    local_width: int
    vocab_size: int

    @property
    def split(self) -> bool:
        """Whether the vocabulary is split over several ranks (tensor parallelism), so this rank lacks part of it."""
        return self.group is not None

    @staticmethod
    def of_head(head: nn.Module) -> "VocabShard":
        """The shard of an output layer: a ``VocabParallelHead`` (under the strategy) or a plain ``nn.Linear``.

        Read from the layer, not from its weight's shard tag: under ZeRO-3 the weight is FSDP's DTensor, whose
        shape is still this rank's tensor-parallel slice."""
        width = head.weight.shape[0]
        real = getattr(head, "real_local_size", None)
        if real is None:  # not split, not padded
            return VocabShard(None, 0, width, width, width)
        group = head.group
        rank = dist.get_rank(group) if group is not None else 0
        return VocabShard(group, rank * width, real, width, head.out_features)


def find_vocab_head(module: nn.Module) -> nn.Module:
    """The one vocab-parallel output layer inside ``module`` (a LightningModule or a model)."""
    heads = [m for m in module.modules() if hasattr(m, "vocab_shard")]
    if len(heads) != 1:
        raise ValueError(
            f"{type(module).__name__} has {len(heads)} vocab-parallel output layers ({[type(h).__name__ for h in heads]}); "
            f"pass the output layer itself (e.g. model.lm_head) to say whose logits these are.")
    return heads[0]


def gather_vocab_logits(logits: Tensor, head: Optional[nn.Module] = None) -> Tensor:
    """The full-vocabulary logits ``[..., vocab_size]`` (padding dropped) from this rank's slice ``[..., V/tp]``.

    For a ``predict_step`` of your own: ``gather_vocab_logits(self(input_ids))``, the same call at every
    tensor-parallel size. It all-gathers over the tensor-parallel group (``tp`` times the memory of the slice);
    at ``tensor_parallel_size=1`` it only drops the vocabulary padding. Training and generation never need it.
    ``head``: the output layer (or a module holding exactly one), needed only for logits that lost their mark
    (a plain tensor: an operation that does not keep it, or a model outside ``Megatron3DStrategy``).
    """
    if isinstance(logits, VocabParallelLogits):
        shard = logits.vocab_shard
    elif head is not None:
        shard = VocabShard.of_head(head if hasattr(head, "weight") else find_vocab_head(head))
    else:
        raise ValueError("These logits carry no vocabulary shard (a plain tensor: the mark of the strategy's output "
                         "layer was lost on the way, or the model runs outside Megatron3DStrategy): call "
                         "gather_vocab_logits on the model's output as it comes, or pass the output layer as head= "
                         "(e.g. head=model.lm_head).")
    plain = as_plain(logits)
    if plain.shape[-1] != shard.local_width:
        raise ValueError(f"Logits of width {plain.shape[-1]} are not this head's slice of {shard.local_width} columns.")
    full = gather_from_tensor_parallel(plain, shard.group)
    return full[..., : shard.vocab_size]


def soft_cap(logits: Tensor, cap: Optional[float]) -> Tensor:
    """``cap * tanh(logits / cap)`` (Gemma's final-logit soft-capping), in the logits' dtype and in transformers'
    order of operations; ``cap=None``: the logits as they are. Element by element, so a rank's vocabulary slice is
    capped alone and the vocab-parallel cross-entropy of the capped slices stays exact. Logits of a
    ``VocabParallelHead`` keep their mark and their padding columns at ``-inf`` (``tanh`` would make them ``-cap``,
    which a softmax would count)."""
    if cap is None:
        return logits
    capped = torch.tanh(as_plain(logits) / cap) * cap
    if not isinstance(logits, VocabParallelLogits):
        return capped
    shard = logits.vocab_shard
    if shard.size != shard.local_width:
        capped = capped.masked_fill(torch.arange(shard.local_width, device=capped.device) >= shard.size, float("-inf"))
    return mark_vocab_parallel(capped, shard)


def as_plain(logits: Tensor) -> Tensor:
    """The same tensor (same storage and autograd graph) without the vocab-parallel mark."""
    return logits.as_subclass(Tensor) if isinstance(logits, VocabParallelLogits) else logits


def mark_vocab_parallel(logits: Tensor, shard: VocabShard) -> Tensor:
    if is_fake(logits):  # a fake tensor (lightning-megatron simulate) cannot become a second subclass: unmarked
        return logits
    marked = logits.as_subclass(VocabParallelLogits)
    marked.vocab_shard = shard
    return marked


class VocabParallelLogits(Tensor):
    """Logits of one rank's slice of the vocabulary, or of the whole padded one at ``tensor_parallel_size=1`` (see
    the module docstring); ``.vocab_shard`` says which."""

    vocab_shard: VocabShard

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NEEDS_FULL_VOCABULARY and _shard_in(args, kwargs).split:
            shard = _shard_in(args, kwargs)
            tp = dist.get_world_size(shard.group) if shard.group is not None else 1
            held = f"ids [{shard.start}, {shard.start + shard.size})" if shard.size else "padding rows"
            raise RuntimeError(
                f"{getattr(func, '__name__', func)}() was given vocab-parallel logits: this rank holds only {held} "
                f"of the {shard.vocab_size}-token vocabulary (padded, split over tensor_parallel_size={tp}). For a "
                f"loss use lightning_megatron.tensor_parallel.vocab_parallel_cross_entropy(logits, labels, group) "
                f"(or the model's own loss); for predictions use gather_vocab_logits(logits) from "
                f"lightning_megatron.tensor_parallel, or the model's predict_step / generate.")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _KEEPS_THE_MARK and isinstance(out, Tensor):
            return mark_vocab_parallel(out, _shard_in(args, kwargs))
        return out


def _shard_in(args, kwargs) -> VocabShard:
    for value in (*args, *kwargs.values()):
        if isinstance(value, VocabParallelLogits):
            return value.vocab_shard
    raise AssertionError("no vocab-parallel logits among the arguments")


_NEEDS_FULL_VOCABULARY = {
    F.cross_entropy, F.nll_loss, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, Tensor.softmax,
    Tensor.log_softmax, torch.argmax, Tensor.argmax, torch.topk, Tensor.topk,
}
_KEEPS_THE_MARK = {
    Tensor.view, Tensor.view_as, Tensor.reshape, Tensor.flatten, torch.flatten, torch.reshape, Tensor.__getitem__,
    Tensor.transpose, torch.transpose, Tensor.permute, torch.permute, Tensor.squeeze, Tensor.unsqueeze,
    Tensor.contiguous, Tensor.clone, Tensor.detach, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16,
    Tensor.to, Tensor.type_as, Tensor.__truediv__, Tensor.__mul__, Tensor.div, Tensor.mul, torch.div, torch.mul,
}
