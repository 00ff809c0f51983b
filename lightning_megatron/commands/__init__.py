"""The tools around training that ``lightning-megatron`` runs besides LightningCLI's ``fit``/``validate``/``test``/
``predict`` (``cli.py``): one module per tool over the package's libraries, at the top of the import order.

``TOOLS`` maps each subcommand to its help (whole sentences) and its ``main(argv)``; each tool parses its own
arguments. A new tool is a module here and a line in ``TOOLS``.
"""

from __future__ import annotations

from typing import Callable, Sequence

from lightning_megatron.commands.checkpoint import main as checkpoint_main
from lightning_megatron.commands.generate import main as generate_main
from lightning_megatron.commands.plan import main as plan_main
from lightning_megatron.commands.preprocess import document_ends_main, train_tokenizer_main
from lightning_megatron.commands.preprocess import main as preprocess_main
from lightning_megatron.commands.simulate import main as simulate_main

# name -> (help in whole sentences, main(argv) function)
TOOLS: dict[str, tuple[str, Callable[[Sequence[str]], None]]] = {
    "preprocess": ("Tokenise .jsonl, .txt and .parquet files, folders of them and Hugging Face datasets directories "
                   "into one Megatron .bin/.idx dataset.", preprocess_main),
    "document-ends": ("Record each document's last token of an existing .bin/.idx dataset in PREFIX.ends, so that "
                      "index builds read only the .idx.", document_ends_main),
    "train-tokenizer": ("Train a byte-level BPE or a BERT WordPiece tokenizer.json.", train_tokenizer_main),
    "checkpoint": ("Inspect, consolidate or convert (to Hugging Face) a checkpoint, sharded or full.",
                   checkpoint_main),
    "generate": ("Continue prompts with a GPT from a checkpoint or a Hugging Face directory (with a KV cache).",
                 generate_main),
    "plan": ("Predict the memory per GPU and the step time of every valid layout of a config on N GPUs, and write "
             "a config that runs the best one (--write-config).", plan_main),
    "simulate": ("Run a config's real training step for chosen ranks of an N-GPU job on this CPU (fake tensors, fake "
                 "process group), and print each rank's peak memory beside the planner's and its collectives.",
                 simulate_main),
}

__all__ = ["TOOLS"]
