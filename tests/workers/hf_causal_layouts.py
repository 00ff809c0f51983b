"""``HFCausalLM``'s modules (transformers' own layers) trained under several layouts over the same processes, as
``layout_invariance`` trains the GPT: ``main(out_dir, [LAYOUTS, DIRECTORY])``, each layout ``{family}-{layout words}``
(``hf_causal_setup.FAMILIES``; the words are ``layout_invariance``'s), the family's ``save_pretrained`` directory
``DIRECTORY/{family}``, read by every rank for its own shards; the word ``lora``: ``gpt_setup.LORA``'s adapters on
every attention and MLP projection (``hf_causal_lm.lora_for``). Rank 0 writes ``{layout}.pt`` (losses, gathered
weights).

``fit-{family}``: ``Trainer.fit`` of ``HFCausalLM(pretrained=...)`` under ``Megatron3DStrategy`` at tp2 x dp2 with
ZeRO-3 (``hf_causal_setup.FIT``) for all steps but the last, then a sharded checkpoint (``fit.ckpt``) and, from the
gathered weights, a ``save_pretrained`` export (``exported``); the last step resumed from the checkpoint at pp2 x dp2
(ZeRO-1), whose ``predict_step`` logits of ``PREDICT_IDS`` every rank writes (``fit-logits{rank}.pt``). The entry is
the global batches' losses.
"""

from functools import partial
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from entry import run_script
from gpt_setup import LORA
from hf_causal_setup import FAMILIES, FIT, PREDICT_IDS, fit_module
from layout_invariance import build, train
from layout_runs import layouts_job
from trainer_setup import datamodule, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.models.hf_family import read_config
from lightning_megatron.models.hf_stages import build_causal_lm, lora_for
from lightning_megatron.models.hf_weights import SafetensorsWeights
from lightning_megatron.peft.lora import apply_lora


def make_model(source: Path, lora: bool):
    model = build_causal_lm(read_config(source), weights=SafetensorsWeights(source))
    if lora:
        apply_lora(model, lora_for(model, LORA))
    return model


def train_family(out_dir: Path, directory: Path, layout: str):
    family, *words = layout.split("-")
    assert family in FAMILIES, f"{layout}: {family!r} is no family of hf_causal_setup"
    make = partial(make_model, directory / family, "lora" in words)
    words = "-".join(word for word in words if word != "lora")  # the adapters on transformers' projections
    return train(out_dir, words, build_model=partial(build, make_model=make))


class Losses(L.Callback):
    """The global batches' losses; ``stop_after``: the run stops after that many steps."""

    def __init__(self, stop_after=None) -> None:
        self.losses, self.stop_after = [], stop_after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))
        if trainer.global_step == self.stop_after:
            trainer.should_stop = True


def fit(out_dir: Path, directory: Path, layout: str) -> list[float]:
    """FIT's steps but the last at its first layout, saving a checkpoint (Lightning's ModelCheckpoint, mid-epoch) and an
    export there; the last step resumed from the checkpoint at the second layout."""
    losses, checkpoint = [], out_dir / "fit.ckpt"
    for strategy, resume in zip(FIT["strategies"], (None, checkpoint)):
        L.seed_everything(FIT["seed"])
        record = Losses(stop_after=FIT["steps"] - 1 if resume is None else None)
        saving = [] if resume else [ModelCheckpoint(dirpath=out_dir, filename="fit",
                                                    every_n_train_steps=FIT["steps"] - 1)]
        trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), callbacks=[record, *saving],
                            strategy=Megatron3DStrategy(**strategy),
                            **{**trainer_kwargs(FIT), "enable_checkpointing": not resume, "limit_val_batches": 0})
        module = fit_module(directory / layout.split("-", 1)[1])
        trainer.fit(module, datamodule=datamodule(FIT), ckpt_path=resume)
        losses += record.losses
        if resume is not None:  # the logits of the resumed model at pp2 x dp2, on every rank
            torch.save(module.predict_step({"input_ids": PREDICT_IDS})["logits"],
                       out_dir / f"fit-logits{dist.get_rank()}.pt")
        if resume is None:
            state_dict = trainer.strategy.full_state_dict(rank_zero_only=True)
            if trainer.is_global_zero:
                module.to_hf(out_dir / "exported", state_dict=state_dict)
            dist.barrier()
    return losses


def main(out_dir: Path, args: list[str]) -> None:
    directory = Path(args[1])
    layouts_job(out_dir, args[0].split(","), partial(train_family, out_dir, directory),
                tools={"fit-": partial(fit, out_dir, directory)})


if __name__ == "__main__":
    run_script(main)
