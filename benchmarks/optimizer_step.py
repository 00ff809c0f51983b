"""AdamW's step time by implementation: torch's per-tensor Python loop, foreach (multi-tensor) and fused, in one table.

Side by side in one process, on the parameters of the same GPT (``--hidden``, default 64: a tiny width, where the
per-tensor launches dominate) at each of ``--layers`` (default 4 and 48), with fixed random gradients:

- ``params``: AdamW over the fp32 model parameters, as ``configure_optimizers`` builds it (two param groups,
  decay and no decay);
- ``pieces``: the same optimizer after the distributed optimizer rebinds it (``optim.main_params``:
  ``MainParamOptimizer`` over a bf16 model, so the optimizer steps on fp32 main pieces, one flat piece per
  tensor, as under Megatron-style mixed precision or ZeRO). Only ``optimizer.step()`` is timed, not the
  copies in and out of the pieces, which are the same for every implementation.

``for_loop`` is what ``torch.optim.AdamW()`` runs on CPU when neither ``foreach`` nor ``fused`` is given (torch
defaults to foreach only on CUDA); the recipe's ``adam_implementation="auto"`` picks ``fused`` where the device
has it (CPU and CUDA). Variants are interleaved round by round (reversed every other round) so that drift on a
shared machine falls on all alike; each cell is the best of ``--repeats`` medians of ``--steps`` steps, and the
ratio is the for-loop's time over the variant's (> 1: faster than the loop).

Example::

    python benchmarks/optimizer_step.py                       # CPU, ~1 minute on 2 idle cores
    python benchmarks/optimizer_step.py --device cuda --hidden 1024 --layers 24
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

from harness.rounds import abba
from harness.tables import format_rows
from lightning_megatron.models import GPTConfig, GPTModel
from lightning_megatron.models.optim_recipe import adamw_implementation
from lightning_megatron.optim.grad_sync import GradientSynchronizer
from lightning_megatron.optim.main_params import MainParamOptimizer

IMPLEMENTATIONS = ("for_loop", "foreach", "fused")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 48])
    parser.add_argument("--vocab", type=int, default=257)
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    return parser.parse_args(argv)


def build(args: argparse.Namespace, layers: int, binding: str, implementation: str):
    """An AdamW (and what steps it) over the GPT's parameters or, rebound, over fp32 main pieces."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, max_seq_length=64, hidden_size=args.hidden, num_layers=layers,
                       num_heads=4)
    model = GPTModel(config).to(args.device)
    if binding == "pieces":
        model.to(torch.bfloat16)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                  **adamw_implementation(params, implementation))
    if binding == "params":
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        return optimizer.step, len(params)
    sync = GradientSynchronizer(params, data_parallel_group=None)
    main = MainParamOptimizer(optimizer, sync)
    for bucket in sync.buckets:
        bucket.shard.copy_(torch.randn(bucket.shard.shape, device=bucket.shard.device) * 1e-3)
    main.prepare_step()  # the pieces' fp32 gradients, once: only the optimizer's own step is timed
    return optimizer.step, len(main.pieces)


def time_run(step, steps: int, device: str) -> float:
    step()  # state allocated outside the clock
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [["layers", "binding", "tensors", *(f"{name} ms" for name in IMPLEMENTATIONS),
             *(f"{name} ratio" for name in IMPLEMENTATIONS[1:])]]
    for layers in args.layers:
        for binding in ("params", "pieces"):
            runs = {name: build(args, layers, binding, name) for name in IMPLEMENTATIONS}
            best = {name: float("inf") for name in IMPLEMENTATIONS}
            for round_ in range(args.repeats):
                for name in abba(IMPLEMENTATIONS, round_):
                    best[name] = min(best[name], time_run(runs[name][0], args.steps, args.device))
            tensors = runs["for_loop"][1]
            rows.append([str(layers), binding, str(tensors), *(f"{best[n] * 1e3:.2f}" for n in IMPLEMENTATIONS),
                         *(f"{best['for_loop'] / best[n]:.2f}" for n in IMPLEMENTATIONS[1:])])
    print(f"AdamW step, GPT h={args.hidden}, vocab {args.vocab}, {args.device}, "
          f"{torch.get_num_threads()} thread(s); ratio = for_loop time / variant time")
    print(format_rows(rows, left=(1,)))


if __name__ == "__main__":
    main()
