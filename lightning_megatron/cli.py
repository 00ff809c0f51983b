"""The ``lightning-megatron`` command.

``fit``/``validate``/``test``/``predict`` go to LightningCLI: any LightningModule and
LightningDataModule by ``class_path`` (``lightning_megatron.models.GPT``, ``...BERT`` or your
own), as the files in ``configs/`` show; the other subcommands are tools around training
(data preprocessing, tokenizers, checkpoints, generation, the planner) in ``commands`` (its ``TOOLS`` table).

Example::

    lightning-megatron fit --config configs/gpt-tiny.yaml --trainer.max_steps=100
"""

from __future__ import annotations

import shutil
import sys
import textwrap
import warnings
from typing import Optional, Sequence

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_megatron  # noqa: F401  (registers the "megatron_3d" strategy)
from lightning_megatron.callbacks import StepRichProgressBar
from lightning_megatron.cli_errors import TRACEBACK_VARIABLE, did_you_mean, parser_keys, report_build_error
from lightning_megatron.commands import TOOLS

# LightningCLI's subcommands, described in whole sentences (its own help cuts the Trainer's docstrings short).
TRAINER_COMMANDS = {
    "fit": "Train the model (validating on the way), or resume with --ckpt_path.",
    "validate": "Run one pass over the validation set.",
    "test": "Run one pass over the test set.",
    "predict": "Run the model over the prediction data (e.g. a GPT over prompts) and return its outputs.",
}


def help_text(width: Optional[int] = None) -> str:
    """``lightning-megatron --help``: every subcommand and every tool, each in whole sentences."""
    width = width or min(shutil.get_terminal_size().columns, 120)
    name_width = max(map(len, [*TRAINER_COMMANDS, *TOOLS])) + 4

    def rows(entries: dict[str, str]) -> list[str]:
        return [textwrap.fill(text, width, initial_indent=f"  {name:<{name_width - 2}}",
                              subsequent_indent=" " * name_width) for name, text in entries.items()]

    return "\n".join([
        "usage: lightning-megatron SUBCOMMAND [options]", "",
        textwrap.fill("Training, with Lightning's CLI: any LightningModule and LightningDataModule by class_path, as "
                      "the files in configs/ show. lightning-megatron SUBCOMMAND --help lists a subcommand's "
                      "options.", width),
        *rows(TRAINER_COMMANDS), "",
        textwrap.fill("Tools around training. lightning-megatron TOOL --help lists a tool's options.", width),
        *rows({name: text for name, (text, _) in TOOLS.items()}), "",
        textwrap.fill(f"Example: lightning-megatron fit --config configs/gpt-tiny.yaml --trainer.max_steps 50. An "
                      f"error raised while the model or the data is built prints its message only; "
                      f"{TRACEBACK_VARIABLE}=1 shows its traceback.", width),
    ])


# LightningCLI warns when it is given ``args`` while ``sys.argv`` holds arguments too, in case a script meant
# one and got the other. ``main`` always decides which: this exact warning, and no other, is not shown.
ARGS_WARNING = "LightningCLI's args parameter is intended to run from within Python"


class MegatronArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, which adds "did you mean" to jsonargparse's error for a misspelled key."""

    def error(self, message: str, ex: Optional[Exception] = None):
        parser = getattr(ex, "subcommand_parser", None) or self
        return super().error(message + did_you_mean(message, parser_keys(parser)), ex)


class MegatronCLI(LightningCLI):
    """LightningCLI as ``lightning-megatron`` runs it: a misspelled key gets "did you mean", an error raised while
    the model, the data or the Trainer is built ends the command with its own message, a ``val_check_interval``
    longer than a ``max_steps`` run validates at its end, and the progress bar of a run by ``max_steps`` reads
    "Epoch 0", not "Epoch 0/-2"."""

    def parse_arguments(self, parser, args) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=ARGS_WARNING, category=UserWarning)
            super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        if self.subcommand in ("fit", None):  # None: run=False, the Trainer is for the caller's own fit
            clamp_val_check_interval((self.config[self.subcommand] if self.subcommand else self.config)["trainer"])

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as error:  # noqa: BLE001  (every error is reported, none is swallowed)
            report_build_error(error)

    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        callbacks = trainer.callbacks
        for index, callback in enumerate(callbacks):
            if type(callback) is RichProgressBar:  # Lightning's default, not one the config chose
                callbacks[index] = StepRichProgressBar()
        return trainer


def clamp_val_check_interval(trainer) -> None:
    """A whole-number ``val_check_interval`` (in batches) larger than the ``max_steps x accumulate_grad_batches``
    batches of the run would never validate (Lightning refuses it when the training data is that short): the run
    validates after its last batch instead, which a log line says (``configs/*.yaml --trainer.max_steps 50``)."""
    interval, max_steps = trainer.get("val_check_interval"), trainer.get("max_steps")
    accumulate = trainer.get("accumulate_grad_batches") or 1
    if isinstance(interval, bool) or not isinstance(interval, int) or not max_steps or max_steps < 0:
        return
    batches = max_steps * accumulate
    if interval > batches:
        trainer["val_check_interval"] = batches
        rank_zero_info(f"val_check_interval={interval} batches is more than this run's {batches} (max_steps="
                       f"{max_steps} x accumulate_grad_batches={accumulate}): validating after batch {batches}, the "
                       f"last, instead.")


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
        parser_class=MegatronArgumentParser,
        args=args,
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``argv``: the arguments after the command's name (``None``: ``sys.argv[1:]``)."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        TOOLS[argv[0]][1](argv[1:])
        return
    if argv and argv[0] in ("-h", "--help"):
        print(help_text())
        return
    run_lightning_cli(None if from_command_line else argv)


if __name__ == "__main__":
    main()
