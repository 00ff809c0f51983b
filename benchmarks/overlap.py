"""Communication overlaps, each on against off, in one table: step time and whether the losses stay identical.

Every overlap the strategy offers is one entry of ``OVERLAPS`` (:class:`Overlap`): its name, the variants it
measures (table rows) and a function that trains a variant with the overlap on or off and returns the step times
and losses. One invocation runs the chosen entries in the same processes (``torchrun`` with ``--ranks``),
round by round, on and off interleaved (off-on, then on-off: drift on a shared machine falls on both alike), on
the same model, batches and learning rates; an overlap changes when communication completes, not what is
computed, so the losses agree exactly (``max loss diff`` 0), or to fp32 rounding where the overlap also splits a
GEMM (``tp_comm``).

Entries:

* ``param_gather``: ZeRO 1/2's all-gather of the updated parameters (``overlap_param_gather``): off, every
  bucket is gathered inside the optimizer step; on, the gathers are launched after the step and each bucket is
  waited for by the first module of the next forward that owns its parameters. A wide, shallow GPT on 16 tokens
  per rank (few FLOPs per parameter) with several buckets, so that on CPU with gloo the gather is a visible part
  of the step. ``wait ms`` is the time blocked in ``ParamGather``'s waits.
* ``tp_comm``: tensor parallelism over all ``--ranks`` with sequence parallelism (``tp_comm_overlap``): off, each
  sequence-parallel linear all-gathers then multiplies (and multiplies then reduce-scatters); on, the column
  linears' all-gather runs behind their own chunk's GEMM. Both overlap the column layers' backward (the input
  re-gather behind the input-gradient GEMM, the reduce-scatter behind the weight-gradient GEMM).
* ``pipeline_p2p``: pipeline parallelism over all ``--ranks``, ``2 x ranks`` micro-batches of one sample
  (``overlap_p2p_comm``): on, the multi-stage schedules post every receive as early as their action table
  allows; off, just before its use.

Each step's time is from its batch start to the next one's (the slowest rank), so the gathers a step launches
are paid in the step that waits for them; a run's time is the median step, and the table shows the best of
``--repeats`` runs (noise only ever slows a run down) and the per-round on/off ratios.

Example::

    python -m benchmarks.overlap                          # CPU, dp=2, a few minutes on 2 idle cores
    python -m benchmarks.overlap --only param_gather --repeats 5
    python -m benchmarks.overlap --device cuda --ranks 8 --hidden 2048 --layers 8 --seq 1024 --batch 4 \
        --precision bf16-true
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import lightning as L
import torch

from lightning_megatron import Megatron3DStrategy
from benchmarks.harness.launch import add_worker_flags, launch_workers, worker_rank_and_device
from benchmarks.harness.rounds import abba, slowest_rank_median
from benchmarks.harness.tables import format_rows
from benchmarks.harness.timing import Stopwatch, StopwatchCallback
from benchmarks.harness.training import gpt_config, make_loader, make_module, quiet_trainer


@dataclass(frozen=True)
class Overlap:
    """One overlap to measure. ``variants(args)``: the names of its rows; ``run(args, variant, on, device)``:
    train that variant with the overlap on or off, returning this rank's ``{"step_seconds": [...], "losses":
    [...], "wait_seconds": [...]}``, the last (per measured step: the time blocked waiting for the communication
    the overlap hides; on, what of it stays exposed) optional."""

    name: str
    variants: Callable[[argparse.Namespace], list[str]]
    run: Callable[[argparse.Namespace, str, bool, torch.device], dict]


class RecordSteps(StopwatchCallback):
    """The stopwatch's callback, keeping every step's loss and, per step (batch start to batch start), the
    seconds a ``wait_clock`` (a function of the strategy that returns a running total) advanced."""

    def __init__(self, stopwatch: Stopwatch, wait_clock: Optional[Callable] = None) -> None:
        super().__init__(stopwatch)
        self.losses: list[float] = []
        self.wait_clock, self.waits, self._last_wait = wait_clock, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self.wait_clock is not None:
            total = self.wait_clock(trainer.strategy)
            self.waits.append(total - self._last_wait)
            self._last_wait = total

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.losses.append(float(outputs["loss"]))


def fit_timed(args: argparse.Namespace, strategy: Megatron3DStrategy, device: torch.device,
              wait_clock: Optional[Callable] = None) -> dict:
    """``throughput.py``'s GPT and synthetic batches, fitted for ``warmup + steps + 1`` steps; the steps after the
    warmup are timed up to the start of the last one (which pays for what the step before it left running)."""
    L.seed_everything(args.seed, verbose=False)  # the same weights and batches on and off
    sized = argparse.Namespace(**{**vars(args), "warmup": args.warmup, "steps": args.steps + 1})
    record = RecordSteps(Stopwatch(args.warmup, args.steps + 1, device, "wall"), wait_clock)
    trainer = quiet_trainer(strategy=strategy, accelerator=device.type, devices=args.ranks, precision=args.precision,
                            max_steps=args.warmup + args.steps + 1, callbacks=[record])
    trainer.fit(make_module(sized), make_loader(sized))
    result = {"step_seconds": record.stopwatch.step_seconds()[:-1], "losses": record.losses}
    if wait_clock is not None:  # waits[i + 1]: from step i's start to step i + 1's
        result["wait_seconds"] = record.waits[args.warmup + 1: args.warmup + args.steps + 1]
    return result


# ---------------------------------------------------------------------------- the overlaps
def _param_gather_variants(args: argparse.Namespace) -> list[str]:
    return [f"dp{args.ranks} z{stage}" for stage in args.zero_stages]


def _gather_wait_clock(strategy: Megatron3DStrategy) -> float:
    """Seconds this rank has spent blocked on parameter all-gathers (in the step when off; in the next forward's
    hooks when on): ``ParamGather``'s one blocking call, timed on the instance."""
    gather = strategy.driver.main_params.gather
    if not hasattr(gather, "waited_seconds"):
        wait_bucket = gather._wait_bucket

        def timed(index: int) -> None:
            start = time.perf_counter()
            wait_bucket(index)
            gather.waited_seconds += time.perf_counter() - start
        gather.waited_seconds, gather._wait_bucket = 0.0, timed
    return gather.waited_seconds


def _param_gather_run(args: argparse.Namespace, variant: str, on: bool, device: torch.device) -> dict:
    stage = int(variant.rsplit("z", 1)[1])
    strategy = Megatron3DStrategy(zero_stage=stage, overlap_param_gather=on, bucket_size_mb=args.bucket_mb)
    return fit_timed(args, strategy, device, wait_clock=_gather_wait_clock)


def _tp_comm_variants(args: argparse.Namespace) -> list[str]:
    return [f"tp{args.ranks} sp"]


def _tp_comm_run(args: argparse.Namespace, variant: str, on: bool, device: torch.device) -> dict:
    strategy = Megatron3DStrategy(tensor_parallel_size=args.ranks, sequence_parallel=True, tp_comm_overlap=on)
    return fit_timed(args, strategy, device)


def _pipeline_p2p_variants(args: argparse.Namespace) -> list[str]:
    variants = [f"pp{args.ranks} interleaved_zero_bubble"]
    if args.layers % (2 * args.ranks) == 0:
        variants.insert(0, f"pp{args.ranks} vpp2 interleaved_1f1b")
    return variants


def _pipeline_p2p_run(args: argparse.Namespace, variant: str, on: bool, device: torch.device) -> dict:
    schedule = variant.rsplit(" ", 1)[1]
    strategy = Megatron3DStrategy(pipeline_parallel_size=args.ranks, virtual_pipeline_size=2 if "vpp2" in variant else 1,
                                  pipeline_schedule=schedule, micro_batch_size=1, overlap_p2p_comm=on)
    micro_batches = argparse.Namespace(**{**vars(args), "batch": max(args.batch, 2 * args.ranks)})  # m = 2p
    return fit_timed(micro_batches, strategy, device)


OVERLAPS: dict[str, Overlap] = {
    overlap.name: overlap for overlap in [
        Overlap("param_gather", _param_gather_variants, _param_gather_run),
        Overlap("tp_comm", _tp_comm_variants, _tp_comm_run),
        Overlap("pipeline_p2p", _pipeline_p2p_variants, _pipeline_p2p_run),
    ]
}


# ---------------------------------------------------------------------------- running and reporting
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(OVERLAPS), default=sorted(OVERLAPS))
    parser.add_argument("--ranks", type=int, default=2, help="processes (data-parallel ranks unless an entry says)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1, help="samples per step and rank")
    parser.add_argument("--vocab", type=int, default=257)
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="the strategy's bucket_size_mb")
    parser.add_argument("--zero-stages", type=int, nargs="+", choices=(1, 2), default=[1, 2])
    parser.add_argument("--steps", type=int, default=10, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps run before the clock starts")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant and setting, interleaved")
    parser.add_argument("--precision", choices=("32-true", "bf16-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (0 = torch's default)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--quick", action="store_true", help="a smoke test: a small model, 2 steps, 1 round")
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.heads, args.steps, args.warmup, args.repeats = 64, 2, 4, 2, 1, 1
        args.bucket_mb = 0.05
    return args


def jobs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(overlap, variant) in table order."""
    return [(name, variant) for name in args.only for variant in OVERLAPS[name].variants(args)]


def worker_main(args: argparse.Namespace) -> None:
    """Every job, ``repeats`` rounds, off and on back to back (their order alternating by round); rank r writes
    ``rank{r}.json``."""
    rank, device = worker_rank_and_device(args.device)
    runs: dict[str, dict[str, list[dict]]] = {}
    for repeat in range(args.repeats):
        for name, variant in jobs(args):
            for on in abba((False, True), repeat):
                if rank == 0:
                    print(f"  round {repeat + 1}/{args.repeats}: {name} {variant} {'on' if on else 'off'} ...",
                          file=sys.stderr, flush=True)
                result = OVERLAPS[name].run(args, variant, on, device)
                job = runs.setdefault(json.dumps([name, variant]), {"on": [], "off": []})
                job["on" if on else "off"].append(result)
    (args.result_dir / f"rank{rank}.json").write_text(json.dumps(runs))


def run_seconds(ranks: list[dict], key: str, setting: str) -> list[float]:
    """Per run (round): the median over steps of the slowest rank's step time."""
    rounds = zip(*(rank[key][setting] for rank in ranks))
    return [slowest_rank_median([run["step_seconds"] for run in one_round]) for one_round in rounds]


def format_table(args: argparse.Namespace, ranks: list[dict]) -> str:
    rows = [["overlap", "variant", "step ms on", "step ms off", "ratio", "per-round ratios", "wait ms on",
             "wait ms off", "max loss diff"]]
    for name, variant in jobs(args):
        key = json.dumps([name, variant])
        on, off = run_seconds(ranks, key, "on"), run_seconds(ranks, key, "off")
        ratios = [a / b for a, b in zip(on, off)]
        diff = max(abs(a - b) for rank in ranks for run_on, run_off in zip(rank[key]["on"], rank[key]["off"])
                   for a, b in zip(run_on["losses"], run_off["losses"]))
        waits = ["-", "-"]
        if "wait_seconds" in ranks[0][key]["on"][0]:  # rank 0's median step wait, median over rounds
            waits = [f"{statistics.median(statistics.median(run['wait_seconds']) for run in ranks[0][key][s]) * 1e3:.1f}"
                     for s in ("on", "off")]
        rows.append([name, variant, f"{min(on) * 1e3:.1f}", f"{min(off) * 1e3:.1f}", f"{min(on) / min(off):.3f}",
                     f"{min(ratios):.3f}-{max(ratios):.3f}", *waits, f"{diff:.1e}"])
    return format_rows(rows, left=range(2))


def describe(args: argparse.Namespace) -> str:
    params = gpt_config(args).num_parameters()
    return (f"Overlaps on vs off: GPT h={args.hidden} layers={args.layers} ({params / 1e6:.2f}M parameters), "
            f"seq={args.seq}, batch={args.batch}/rank, {args.ranks} processes, bucket_size_mb={args.bucket_mb}, "
            f"{args.device} {args.precision}, threads/process={args.threads or 'default'}, torch {torch.__version__}, "
            f"lightning {L.__version__}\n"
            f"step ms: median step (batch start to batch start, slowest rank) over {args.steps} steps after "
            f"{args.warmup} warmup, best of {args.repeats} interleaved rounds. ratio: on / off (< 1: the overlap "
            f"saves time). wait ms: rank 0's time per step blocked on the communication the overlap hides (off: all of "
            f"it; on: what stays exposed), median. max loss diff: over every step of every round (0: the same "
            f"computation).")


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    ranks = launch_workers(__spec__.name, args.ranks, args.threads, argv)
    print(describe(args))
    print(format_table(args, ranks))


if __name__ == "__main__":
    main()
