"""The ``lightning-megatron`` command.

``fit``/``validate``/``test``/``predict`` go to LightningCLI: any LightningModule and
LightningDataModule by ``class_path`` (``lightning_megatron.models.GPT``, ``...BERT`` or your
own), as the files in ``configs/`` show; the other subcommands are tools around training
(data preprocessing, tokenizers, checkpoints) registered in ``TOOLS``.

Example::

    lightning-megatron fit --config configs/gpt-tiny.yaml --trainer.max_steps=100
"""

from __future__ import annotations

import sys
import warnings
from typing import Callable, Optional, Sequence

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_megatron  # noqa: F401  (registers the "megatron_3d" strategy)
from lightning_megatron.checkpoint.commands import main as checkpoint_main
from lightning_megatron.data.preprocess import document_ends_main
from lightning_megatron.data.preprocess import main as preprocess_main
from lightning_megatron.generation.cli import main as generate_main
from lightning_megatron.plan.command import main as plan_main
from lightning_megatron.data.preprocess import train_tokenizer_main

# name -> (one-line help, main(argv) function); each tool parses its own arguments.
TOOLS: dict[str, tuple[str, Callable[[Sequence[str]], None]]] = {
    "preprocess": ("tokenise a .jsonl/.txt/.parquet file or a Hugging Face datasets directory into a Megatron "
                   ".bin/.idx dataset", preprocess_main),
    "document-ends": ("record each document's last token of an existing .bin/.idx dataset in PREFIX.ends (index "
                      "builds then read only the .idx)", document_ends_main),
    "train-tokenizer": ("train a byte-level BPE or BERT WordPiece tokenizer.json", train_tokenizer_main),
    "checkpoint": ("inspect, consolidate or convert (Hugging Face) a checkpoint, sharded or full", checkpoint_main),
    "generate": ("continue prompts with a GPT from a checkpoint or a Hugging Face directory (KV cache)", generate_main),
    "plan": ("predict memory per GPU and step time of every valid layout of a config on N GPUs; write the best",
             plan_main),
}


# LightningCLI warns when it is given ``args`` while ``sys.argv`` holds arguments too, in case a script meant
# one and got the other. ``main`` always decides which: this exact warning, and no other, is not shown.
ARGS_WARNING = "LightningCLI's args parameter is intended to run from within Python"


class MegatronCLI(LightningCLI):
    """LightningCLI as ``lightning-megatron`` runs it (nothing else differs)."""

    def parse_arguments(self, parser, args) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=ARGS_WARNING, category=UserWarning)
            super().parse_arguments(parser, args)


def run_lightning_cli(args: Optional[Sequence[str]] = None) -> LightningCLI:
    """LightningCLI over ``args`` (``None``: ``sys.argv[1:]``)."""
    # Subclass mode without a default model: a default would leak its hyper-parameter
    # defaults (GPT's betas, weight decay) into a BERT config that does not repeat them.
    return MegatronCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``argv``: the arguments after the command's name (``None``: ``sys.argv[1:]``)."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        TOOLS[argv[0]][1](argv[1:])
        return
    if argv and argv[0] in ("-h", "--help") and TOOLS:
        print("Tools: " + "; ".join(f"{name}: {help_}" for name, (help_, _) in TOOLS.items()))
    run_lightning_cli(None if from_command_line else argv)


if __name__ == "__main__":
    main()
