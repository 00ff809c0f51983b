"""A GPT that goes wrong on purpose, through its own loss and gradients (nothing of ours is patched)."""

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_megatron.models import GPT

BAD_STEP = 2  # the global step at which the multi-process runs go wrong (tests/test_fault_nonfinite.py)


class FaultyGPT(GPT):
    """At the global steps ``nan_steps`` the loss is multiplied by NaN; at ``inf_grad_steps`` the loss
    stays finite but one parameter's gradient becomes Inf (a tensor hook on it). Only on the global
    ranks ``ranks`` (None: every rank). ``sgd_lr`` replaces the AdamW recipe by plain SGD, whose
    update is proportional to the clipped gradient (clipping by a wrong norm would show)."""

    nan_steps: tuple = ()
    inf_grad_steps: tuple = ()
    ranks = None
    sgd_lr = None

    def _here(self, steps) -> bool:
        return self.global_step in steps and (self.ranks is None or self.trainer.global_rank in self.ranks)

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self._here(self.nan_steps):
            out["loss"] = out["loss"] * float("nan")
        if self._here(self.inf_grad_steps):
            param = next(p for p in self.parameters() if p.requires_grad)
            handle = None

            def to_inf(grad):
                handle.remove()  # this backward only
                return torch.full_like(grad, float("inf"))

            handle = param.register_hook(to_inf)
        return out

    def configure_optimizers(self):
        if self.sgd_lr is None:
            return super().configure_optimizers()
        return torch.optim.SGD(self.parameters(), lr=self.sgd_lr)


def faulty(model: GPT, *, nan_steps=(), inf_grad_steps=(), ranks=None, sgd_lr=None) -> FaultyGPT:
    """``model``'s config and hyper-parameters, with the given faults."""
    gpt = FaultyGPT(**model.hparams)
    gpt.nan_steps, gpt.inf_grad_steps, gpt.ranks, gpt.sgd_lr = tuple(nan_steps), tuple(inf_grad_steps), ranks, sgd_lr
    return gpt


def local_parameters(module) -> list[torch.Tensor]:
    return [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in module.parameters()]


class RecordSteps(L.Callback):
    """Per finished step: the loss, a checksum of this rank's parameters, and whether they are all finite."""

    def __init__(self):
        self.losses, self.checksums, self.finite = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.strategy.wait_for_parameters()  # under overlap_param_gather the step's gathers may be in flight
        params = local_parameters(pl_module)
        self.losses.append(float(outputs["loss"]))
        self.checksums.append(float(sum(p.double().sum() for p in params)))
        self.finite.append(all(bool(torch.isfinite(p).all()) for p in params))
