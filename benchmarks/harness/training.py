"""The tiny GPT the training benchmarks share: its config from the size flags, synthetic batches in a fixed
order, and a Trainer that only trains (no logger, checkpoints, progress bar or summary to time)."""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_megatron.models.gpt import GPT, GPTConfig

DEFAULT_VOCAB = {"gpt": 257, "llama": 32000}  # the byte tokenizer; Llama-2's / Mistral-v0.1's vocabulary


def model_name(args: argparse.Namespace) -> str:
    """The one model a worker (or a per-model copy of the arguments) runs; other benchmarks' arguments: gpt."""
    model = getattr(args, "model", "gpt")
    return model if isinstance(model, str) else model[0]


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    """The model the size flags describe: GPT-2-shaped, or ``llama-tiny`` resized where ``args.model`` is llama."""
    vocab = args.vocab or DEFAULT_VOCAB[model_name(args)]
    ffn = getattr(args, "ffn", None)
    if model_name(args) == "llama":
        groups = getattr(args, "query_groups", None) or max(1, args.heads // 2)
        return GPTConfig.from_name("llama-tiny", vocab_size=vocab, max_seq_length=args.seq, hidden_size=args.hidden,
                                   num_layers=args.layers, num_heads=args.heads, num_query_groups=groups,
                                   ffn_hidden_size=ffn or args.hidden * 11 // 4)
    return GPTConfig(vocab_size=vocab, max_seq_length=args.seq, hidden_size=args.hidden,
                     num_layers=args.layers, num_heads=args.heads, ffn_hidden_size=ffn)


def total_steps(args: argparse.Namespace) -> int:
    return args.warmup + args.steps


def make_module(args: argparse.Namespace, cls: type[GPT] = GPT) -> GPT:
    """GPT whose learning-rate warmup spans the whole run.

    The cosine after warmup is sized by the Trainer's step count, which a loop outside the
    Trainer does not have; inside the warmup the schedule depends on the step alone, so
    every variant runs the same learning rates and should end at the same loss.
    """
    return cls(gpt_config(args), warmup_steps=total_steps(args))


class SyntheticTokens(Dataset):
    """Random token ids made once in memory: loading costs every variant the same (almost nothing)."""

    def __init__(self, num_samples: int, seq: int, vocab: int, seed: int) -> None:
        tokens = torch.randint(vocab, (num_samples, seq + 1), generator=torch.Generator().manual_seed(seed))
        self.input_ids, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def make_loader(args: argparse.Namespace, ranks: int = 1, rank: int = 0) -> DataLoader:
    """Exactly ``warmup + steps`` batches of ``rank``'s share of ``ranks`` data-parallel ranks, in a fixed order;
    the explicit sampler keeps Lightning from re-sampling, so every variant sees the same per-rank batches.

    With dp=1 (the default) all ranks (and the plain loop) see the same batch at every step.
    """
    dataset = SyntheticTokens(total_steps(args) * args.batch * ranks, args.seq, gpt_config(args).vocab_size, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=ranks, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)


def quiet_trainer(**kwargs) -> L.Trainer:
    """``L.Trainer(**kwargs)`` without the logger, checkpointing, progress bar and model summary (``kwargs`` may
    turn one back on): a measured run pays only for training."""
    return L.Trainer(**{"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                        "enable_model_summary": False, **kwargs})
