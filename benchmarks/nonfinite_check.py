"""What the non-finite check costs per optimizer step: ``on_nonfinite="error"`` against ``"ignore"``, in one table.

Side by side in one invocation, on the same GPT, batches, AdamW and learning rates: the tiny
GPT (``gpt-tiny``: h=64, 4 layers) and a wider one (h=256), each with gradient clipping on and
off, each with the check on (``"error"``, the default) and off (``"ignore"``, the behaviour
before the check existed).

What to expect (``lightning_megatron/optim/nonfinite.py``): with clipping on, the check measures
the global gradient norm that clipping needs anyway and the clip reuses it, so the check adds
two numbers to the same all-reduce and per-micro-batch loss flags (tiny device ops): a ratio of
1.00 up to noise. With clipping off, it adds what clipping's norm costs: one pass over the
gradients (their squares), one small all-reduce over the world, one host synchronisation.

All runs of one invocation share its processes (``torchrun`` when ``--ranks`` > 1; step time,
not peak memory, is measured here, so nothing needs a fresh process), interleaved round by
round, in reversed order every other round, so drift on a shared machine falls on every
variant alike. Each run's time is the median of its step times (``throughput.py``'s
``Stopwatch``: the slowest rank per step); the table shows the best run of ``--repeats``
(noise only ever slows a run down) and the range of the per-round error/ignore ratios.

Example::

    python benchmarks/nonfinite_check.py                     # CPU, 1 process, a few minutes on 2 idle cores
    python benchmarks/nonfinite_check.py --ranks 2           # dp=2: the all-reduce crosses processes
    python benchmarks/nonfinite_check.py --device cuda --precision bf16-mixed --seq 1024 --batch 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import lightning as L
import torch

from lightning_megatron import Megatron3DStrategy
from harness.launch import add_worker_flags, launch_workers, worker_rank_and_device
from harness.rounds import abba, slowest_rank_median
from harness.tables import format_rows
from harness.timing import Stopwatch, StopwatchCallback
from harness.training import gpt_config, make_loader, make_module, quiet_trainer

MODELS = {"tiny": {"hidden": 64, "layers": 4, "heads": 4}, "wide": {"hidden": 256, "layers": 4, "heads": 8}}
CLIP = 1.0


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "wide"])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="samples per step and rank")
    parser.add_argument("--vocab", type=int, default=257)
    parser.add_argument("--steps", type=int, default=30, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps run before the clock starts")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved")
    parser.add_argument("--ranks", type=int, default=1, help="processes (data-parallel ranks)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="tensor_parallel_size (divides --ranks)")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed", "bf16-true"), default="32-true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (0 = torch's default)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="CPU only: 'cpu' times steps by the CPU time each process got, which other jobs on a "
                             "shared machine cannot inflate (harness/timing.py's Stopwatch); wall time counts waiting "
                             "in collectives too")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny model, 3 steps, 1 round")
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.warmup, args.repeats, args.seq = ["tiny"], 3, 1, 1, 32
    return args


def variants(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """(model, clipping, on_nonfinite) in table order."""
    return [(model, clip, mode) for model in args.models for clip in (True, False) for mode in ("ignore", "error")]


def model_args(args: argparse.Namespace, model: str) -> argparse.Namespace:
    """``throughput.py``'s argument names, so its GPT recipe and synthetic batches serve here too."""
    return argparse.Namespace(**{**vars(args), **MODELS[model]})


class TimedStrategy(Megatron3DStrategy):
    """Also clocks, per step, the two places a global norm is taken: the check (which measures it) and the
    clip (which measures it only when the check did not): the cost of the check itself, without the
    noise of whole steps. Both end in a host synchronisation, so wall time is exact on CUDA too."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.norm_seconds: dict[int, float] = {}

    def _timed(self, method, *args):
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            step = self.lightning_module.trainer.global_step
            self.norm_seconds[step] = self.norm_seconds.get(step, 0.0) + time.perf_counter() - start

    def _check_nonfinite(self, optimizer):
        return self._timed(super()._check_nonfinite, optimizer)

    def clip_grad_by_global_norm(self, optimizer, clip_val):
        return self._timed(super().clip_grad_by_global_norm, optimizer, clip_val)


def run_once(args: argparse.Namespace, model: str, clip: bool, mode: str, device: torch.device) -> dict:
    sized = model_args(args, model)
    L.seed_everything(args.seed, verbose=False)  # the same weights and batches in every variant
    stopwatch = StopwatchCallback(Stopwatch(args.warmup, args.steps, device, args.clock))
    strategy = TimedStrategy(tensor_parallel_size=args.tensor_parallel, on_nonfinite=mode)
    trainer = quiet_trainer(strategy=strategy, accelerator=device.type, devices=args.ranks, precision=args.precision,
                            max_steps=args.warmup + args.steps, gradient_clip_val=CLIP if clip else None,
                            callbacks=[stopwatch])
    trainer.fit(make_module(sized), make_loader(sized))
    norm = [strategy.norm_seconds.get(step, 0.0) for step in range(args.warmup, args.warmup + args.steps)]
    return {"step_seconds": stopwatch.stopwatch.step_seconds(), "norm_seconds": norm, "loss": stopwatch.last_loss.item()}


def worker_main(args: argparse.Namespace) -> None:
    """Every variant, ``repeats`` rounds (ABBA order), in this process; rank r writes ``rank{r}.json``."""
    rank, device = worker_rank_and_device(args.device)
    order = variants(args)
    runs: dict[str, list[dict]] = {json.dumps(v): [] for v in order}
    for repeat in range(args.repeats):
        for variant in abba(order, repeat):
            if rank == 0:
                print(f"  round {repeat + 1}/{args.repeats}: {variant} ...", file=sys.stderr, flush=True)
            runs[json.dumps(variant)].append(run_once(args, *variant, device))
    (args.result_dir / f"rank{rank}.json").write_text(json.dumps(runs))


def run_seconds(ranks: list[dict], key: str, field: str = "step_seconds") -> list[float]:
    """Per run (round): the median over steps of the slowest rank's time."""
    rounds = zip(*(rank[key] for rank in ranks))
    return [slowest_rank_median([r[field] for r in run]) for run in rounds]


def format_table(args: argparse.Namespace, ranks: list[dict]) -> str:
    header = ["model", "params", "clip", "ignore ms/step", "error ms/step", "ratio", "per-round ratios",
              "extra ms", "norm ms ignore", "norm ms error", "same loss"]
    rows = [header]
    for model in args.models:
        params = f"{gpt_config(model_args(args, model)).num_parameters() / 1e6:.2f}M"
        for clip in (True, False):
            off, on = (json.dumps([model, clip, mode]) for mode in ("ignore", "error"))
            off_s, on_s = run_seconds(ranks, off), run_seconds(ranks, on)
            ratios = [b / a for a, b in zip(off_s, on_s)]
            norm_off, norm_on = (min(run_seconds(ranks, key, "norm_seconds")) * 1e3 for key in (off, on))
            same = all(a["loss"] == b["loss"] for rank in ranks for a, b in zip(rank[off], rank[on]))
            rows.append([model, params, "on" if clip else "off", f"{min(off_s) * 1e3:.2f}", f"{min(on_s) * 1e3:.2f}",
                         f"{min(on_s) / min(off_s):.3f}", f"{min(ratios):.3f}-{max(ratios):.3f}",
                         f"{(min(on_s) - min(off_s)) * 1e3:+.2f}", f"{norm_off:.3f}", f"{norm_on:.3f}",
                         "yes" if same else "NO"])
    return format_rows(rows, left=range(3))


def describe(args: argparse.Namespace) -> str:
    return (f"on_nonfinite='error' vs 'ignore': GPT seq={args.seq} vocab={args.vocab}, batch={args.batch}/rank, "
            f"{args.ranks} process(es) tp={args.tensor_parallel}, {args.device} {args.precision}, clip={CLIP} when on, "
            f"threads/process={args.threads or 'default'}, {args.clock} clock, torch {torch.__version__}, "
            f"lightning {L.__version__}\n"
            f"ms/step: median step time over {args.steps} steps after {args.warmup} warmup, best of {args.repeats} "
            f"interleaved rounds. ratio: error / ignore (1.000 = free). norm ms: time per step in the check and the "
            f"clip's norm (each measures it once at most), best round's median. same loss: the last losses agree "
            f"exactly.")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args)
        return
    ranks = launch_workers(__file__, args.ranks, args.threads, sys.argv[1:])
    print(describe(args))
    print(format_table(args, ranks))


if __name__ == "__main__":
    main()
