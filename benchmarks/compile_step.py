"""Regional compilation (``Megatron3DStrategy(compile=...)``): step time against eager, compile time and graphs.

One process, the GPT built as the strategy builds it at tp=1 (the tensor-parallel plan with the per-rank dropout
stream's hooks, then ``preparation.compile_blocks``), forward + backward + AdamW (fused) per step, at each of
``--widths``. Per width and backend: the first step (compilation included; inductor's cache is a fresh directory
per invocation unless ``--warm-cache``), the median of ``--steps`` later steps against eager (interleaved round
by round), the graphs dynamo made (for all layers together) and its recompilations.

Example::

    python benchmarks/compile_step.py                        # CPU, a few minutes on 2 cores (inductor's gcc)
    python benchmarks/compile_step.py --widths 64 --backends aot_eager
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist

from harness.rounds import abba
from harness.tables import format_rows
from lightning_megatron.models import GPTConfig, GPTModel
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.strategy.preparation import compile_blocks
from lightning_megatron.tensor_parallel import parallelize


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--backends", nargs="+", default=["inductor", "aot_eager"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's default on-disk cache")
    return parser.parse_args(argv)


def build(args: argparse.Namespace, width: int, compile: Optional[dict], state: ParallelState):
    config = GPTConfig(vocab_size=257, max_seq_length=args.seq, hidden_size=width, num_layers=args.layers,
                       num_heads=4)
    with torch.device("meta"):
        model = GPTModel(config)
    rng = TensorParallelRNG(0, 0, torch.device("cpu"))
    parallelize(model, model.tensor_parallel_plan(), state, rng=rng)
    compile_blocks(model, compile, state.config, "none")
    initialize_parameters(model, 0, device="cpu", only_meta=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 257, (args.batch, args.seq + 1), generator=generator)

    def step() -> float:
        start = time.perf_counter()
        loss_sum, count = model.loss(tokens[:, :-1], tokens[:, 1:])
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    return step


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    state = ParallelState.create(ParallelConfig(), "cpu")
    from torch._dynamo.utils import counters

    rows = [["width", "variant", "first step s", "step ms", "eager / variant", "graphs", "recompiles"]]
    for width in args.widths:
        variants = {"eager": None, **{backend: {"backend": backend} for backend in args.backends}}
        steps, first, graphs = {}, {}, {}
        for name, compile in variants.items():
            torch._dynamo.reset()
            counters.clear()
            steps[name] = build(args, width, compile, state)
            first[name] = steps[name]()
            graphs[name] = (counters["stats"]["unique_graphs"], sum(counters["recompiles"].values()))
        best = {name: float("inf") for name in variants}
        names = list(variants)
        for round_ in range(args.repeats):
            for name in abba(names, round_):
                best[name] = min(best[name], statistics.median(steps[name]() for _ in range(args.steps)))
        for name in names:
            rows.append([str(width), name, f"{first[name]:.1f}", f"{best[name] * 1e3:.1f}",
                         f"{best['eager'] / best[name]:.2f}" if name != "eager" else "-",
                         str(graphs[name][0]) if name != "eager" else "-",
                         str(graphs[name][1]) if name != "eager" else "-"])
    print(f"GPT {args.layers} layers, seq {args.seq}, batch {args.batch}, tp=1, CPU {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}; inductor cache {'warm' if args.warm_cache else 'cold'}")
    print(format_rows(rows, left=(1,)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
