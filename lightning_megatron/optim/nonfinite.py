"""Stop (or skip) an optimizer step whose loss or gradients are not finite, the same way on every rank.

Why: without a check one NaN (a bad batch, a learning rate too high, an overflow in a bf16
activation) reaches the optimizer, the data-parallel all-reduce spreads it, the weights of
every rank become NaN, and the run trains on, checkpoints NaN weights and exits 0.
Megatron-LM checks the loss and the gradient norm by default and stops; so does
``Megatron3DStrategy(on_nonfinite="error")``, or it skips the step on every rank
(``on_nonfinite="skip"``, as fp16 does on an overflow) up to ``max_consecutive_skips`` in a row.

How, with no collective that clipping does not already make: the global gradient norm that
clipping needs is computed once per step, right after the gradients are reduced and before
Lightning's hooks, clipping and the optimizer see them (clipping then reuses it). The
micro-batch losses are checked with it: each micro-batch adds ``loss * 0`` (0 for a finite
loss, NaN for a NaN or an Inf; a device tensor: no host sync per micro-batch); the step's sum is
summed over dp in the all-reduce that already sums the token count (``grad_sync.sum_tokens``)
and added to the squared norm (float64) before its all-reduce over tp x pp. Adding 0 leaves a
finite norm bit for bit as it was, and a NaN anywhere makes every rank's sum NaN, so the verdict
(is the sum finite?) is identical everywhere: all ranks raise (or skip) together and none is
left waiting in a collective. The step costs one host synchronisation for the verdict and a
handful of scalar operations besides the norm. Only on a non-finite verdict does one more
all-reduce collect which rank saw what (its NaN and Inf losses, its non-finite gradients), for
the message.

The squares are those ``clip.py`` (and ``ZeRO3.grad_norm``) count, summed over the same groups
in the same order: sharded tensor-parallel parameters on every tp rank, replicated ones on tp
rank 0, a pipeline-tied copy once; over tp x pp, and over dp where dp ranks hold different
pieces (ZeRO). The norm is therefore bit for bit the one clipping always used. With tp = pp = 1
and no ZeRO there is nothing to sum: the check then adds no collective at all. (A callback that
changes gradients in ``on_before_optimizer_step`` is clipped by the norm measured before it ran.)

fp16 (``16-true`` with the strategy's ``DynamicLossScaler``, ``16-mixed`` with Lightning's
``GradScaler``) is not checked here: there a non-finite gradient is an expected overflow, which
the loss scaler answers by skipping the step on every rank and lowering the scale.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

MODES = ("error", "skip", "ignore")


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were NaN/Inf; raised on every rank before the optimizer stepped."""


def loss_flags(loss: Tensor) -> Tensor:
    """``[loss has a NaN, loss has an Inf]`` of one micro-batch, float64 on the loss's device (no host sync)."""
    loss = loss.detach()
    return torch.stack([torch.isnan(loss).any(), torch.isinf(loss).any()]).to(torch.float64)


def loss_poison(loss: Tensor) -> Tensor:
    """0 for a finite loss, NaN for one with a NaN or an Inf (``inf * 0`` is NaN): added to the squared
    gradient norm, it leaves a finite norm exactly as it is and turns the verdict of a bad loss non-finite."""
    return (loss.detach() * 0.0).sum()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class NonFiniteCheck:
    """The policy for non-finite steps, and its counters (the same on every rank).

    Args:
        mode: ``"error"`` raises :class:`NonFiniteError` on every rank; ``"skip"`` drops the
            step's gradients on every rank (the optimizer does not step; the learning-rate
            schedule and ``global_step`` move on, as for an fp16 overflow); ``"ignore"`` checks
            nothing (the behaviour before the check existed: for benchmarks and experts).
        max_consecutive_skips: under ``"skip"``, the most steps in a row that may be skipped;
            one more non-finite step in a row raises, since a run that only skips is not training.
    """

    def __init__(self, mode: str = "error", max_consecutive_skips: int = 10) -> None:
        if mode not in MODES:
            raise ValueError(f"on_nonfinite={mode!r} is not one of {MODES}: 'error' stops the run, 'skip' skips the "
                             f"step on every rank, 'ignore' trains on as if nothing happened.")
        if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int) \
                or max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be a positive integer, got {max_consecutive_skips!r} "
                             f"(to skip no step, pass on_nonfinite='error').")
        self.mode, self.max_consecutive_skips = mode, max_consecutive_skips
        self.skipped_steps = 0
        self.consecutive_skips = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "ignore"

    def global_norm(self, local_squares: Tensor, poison: Tensor, groups: Sequence[Optional[dist.ProcessGroup]], *,
                    device: torch.device) -> tuple[Tensor, bool]:
        """The global gradient norm and whether the step is finite, identical on every rank.

        ``local_squares``: this rank's share of the squared norm; ``poison``: :func:`loss_poison` of
        its losses, already summed over dp (it rode along with the token count), so NaN if any
        loss of the dp group was not finite. ``groups``: where the squares are summed, in the order
        clipping sums them (None: nothing to sum). One host synchronisation, for the verdict."""
        squares = poison.detach().to(device=device, dtype=torch.float64).reshape(()) + local_squares.detach().to(device)
        for group in groups:
            if group is not None:
                dist.all_reduce(squares, group=group)
        finite = bool(torch.isfinite(squares))  # the step's one host sync
        return squares.sqrt().float(), finite

    def passed(self) -> None:
        """A finite step: the run of skips is over."""
        self.consecutive_skips = 0

    def non_finite(self, losses: Optional[Tensor], *, grads_finite: bool, step: int, epoch: int,
                   device: torch.device) -> str:
        """Called on every rank after a non-finite verdict: raise, or count a skip and return its warning.

        One all-reduce gathers each rank's flags (NaN loss, Inf loss, a non-finite local gradient)
        so that the message names the ranks, identically everywhere."""
        rank, world = _world()
        table = torch.zeros(world, 3, dtype=torch.float64, device=device)
        if losses is not None:
            table[rank, :2] = losses.to(device)
        table[rank, 2] = 0.0 if grads_finite else 1.0
        if world > 1:
            dist.all_reduce(table)
        what = _describe(table.cpu())
        where = f"Non-finite loss or gradients at global step {step} (epoch {epoch}): {what}."
        self.consecutive_skips += 1
        if self.mode == "skip" and self.consecutive_skips <= self.max_consecutive_skips:
            self.skipped_steps += 1
            return (f"{where} Step skipped on every rank (on_nonfinite='skip': {self.consecutive_skips} in a row, "
                    f"max_consecutive_skips={self.max_consecutive_skips}).")
        if self.mode == "skip":
            raise NonFiniteError(
                f"{where} That is {self.consecutive_skips} non-finite steps in a row, more than "
                f"max_consecutive_skips={self.max_consecutive_skips} lets on_nonfinite='skip' skip. The optimizer did "
                f"not step and no checkpoint of this state was written. Lower the learning rate, check the data of "
                f"these steps, or raise max_consecutive_skips."
            )
        raise NonFiniteError(
            f"{where} The optimizer did not step and no checkpoint of this state was written. Lower the learning "
            f"rate, check the data of that step, or pass on_nonfinite='skip' to Megatron3DStrategy to skip such "
            f"steps on every rank (at most max_consecutive_skips={self.max_consecutive_skips} in a row)."
        )


def _describe(table: Tensor) -> str:
    """'loss is nan on ranks [1]; gradients non-finite on ranks [0, 1]' from the gathered flags."""
    ranks = lambda column: [r for r in range(table.shape[0]) if table[r, column] > 0]  # noqa: E731
    parts = [f"loss is {kind} on ranks {ranks(column)}" for column, kind in ((0, "nan"), (1, "inf")) if ranks(column)]
    if not parts:
        parts.append("the loss is finite on every rank")
    if ranks(2):
        parts.append(f"gradients non-finite on ranks {ranks(2)}")
    elif len(parts) == 1 and parts[0].startswith("the loss is finite"):
        parts.append("every gradient is finite, but the sum of their squares overflows float32 (a gradient norm "
                     "above about 1e19)")
    return "; ".join(parts)
