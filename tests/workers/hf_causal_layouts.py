"""``HFCausalLM``'s modules (transformers' own layers) trained under several layouts over the same processes, as
``layout_invariance`` trains the GPT: ``main(out_dir, [LAYOUTS, DIRECTORY])``, each layout ``{family}-{layout words}``
(``hf_causal_setup.FAMILIES``; the words are ``layout_invariance``'s), the family's ``save_pretrained`` directory
``DIRECTORY/{family}``, read by every rank for its own shards; the word ``lora``: ``gpt_setup.LORA``'s adapters on
every attention and MLP projection (``hf_causal_lm.lora_for``). Rank 0 writes ``{layout}.pt`` (losses, gathered
weights).

``fit-{family}``: ``Trainer.fit`` of ``HFCausalLM(pretrained=...)`` under ``Megatron3DStrategy`` at tp2 x dp2 with
ZeRO-3 (``hf_causal_setup.FIT``), which then saves a sharded checkpoint (``fit.ckpt``) and, from the gathered weights,
a ``save_pretrained`` export (``exported``); the entry is the global batches' losses.
"""

from functools import partial
from pathlib import Path

import lightning as L
import torch.distributed as dist

from entry import run_script
from gpt_setup import LORA
from hf_causal_setup import FAMILIES, FIT, fit_module
from layout_invariance import build, train
from layout_runs import layouts_job
from trainer_setup import datamodule, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.models.hf_causal_lm import SafetensorsWeights, build_causal_lm, lora_for, read_config
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
    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))


def fit(out_dir: Path, directory: Path, layout: str) -> list[float]:
    L.seed_everything(FIT["seed"])
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), callbacks=[losses],
                        strategy=Megatron3DStrategy(**FIT["strategy"]), **trainer_kwargs(FIT))
    module = fit_module(directory / layout.split("-", 1)[1])
    trainer.fit(module, datamodule=datamodule(FIT))
    trainer.save_checkpoint(out_dir / "fit.ckpt")
    state_dict = trainer.strategy.full_state_dict(rank_zero_only=True)
    if trainer.is_global_zero:
        module.to_hf(out_dir / "exported", state_dict=state_dict)
    dist.barrier()
    return losses.losses


def main(out_dir: Path, args: list[str]) -> None:
    directory = Path(args[1])
    layouts_job(out_dir, args[0].split(","), partial(train_family, out_dir, directory),
                tools={"fit-": partial(fit, out_dir, directory)})


if __name__ == "__main__":
    run_script(main)
