"""Measured vs theoretical pipeline bubble, with synthetic stages of known cost, on the CPU.

Each stage sleeps a fixed time per micro-batch (forward ``t``, backward ``2t``: ``t`` for the
input gradient and ``t`` for the weight gradient, which the zero-bubble schedules run as two
passes; all split over the virtual stages of a rank), so the schedule alone decides the idle
time. The table compares the measured bubble (share of the step a rank computes nothing) with
theory: ``(p-1)/m`` of the ideal time for 1F1B and GPipe, divided by ``v`` when interleaved;
for the zero-bubble schedules, their own action table played out with these costs
(``lightning_megatron.pipeline.timeline.simulated_bubble``).

    python -m benchmarks.pipeline_bubble                 # 4 ranks, 8 micro-batches
    python -m benchmarks.pipeline_bubble --ranks 4 --micro-batches 16 --plot docs/pipeline_timeline.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.launch import torchrun, worker_env
from lightning_megatron.pipeline.blocks import PipelineBatch
from lightning_megatron.pipeline.layout import PipelineLayout
from lightning_megatron.pipeline.runner import PipelineRunner
from lightning_megatron.pipeline.timeline import TimelineRecorder, measured_bubble, render, schedule_theory

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zero_bubble", 1),
             ("interleaved_zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)]


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed wall time, like a stage of known cost."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SyntheticStage(nn.Module):
    """Forward ``t``; backward ``t`` on the input's path and ``t`` on the weight's (a split backward's two passes)."""

    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.forward_s = forward_s

    def forward(self, x):
        weight = _Sleep.apply(self.scale, 0.0, self.forward_s)
        return _Sleep.apply(x, self.forward_s, self.forward_s) * weight


class SyntheticModel:
    """The pipeline protocol's batch and loss half (see lightning_megatron/pipeline/blocks.py), trivially."""

    def pipeline_batch(self, inputs, labels):
        return PipelineBatch(inputs=(inputs,), target=labels, num_tokens=torch.tensor(labels.numel()))

    def pipeline_loss(self, output, target):
        return (output * 0 + target.unsqueeze(-1).float()).sum(), {}

    def pipeline_result(self, loss_sum, num_tokens, extras):
        return loss_sum, num_tokens


def worker(args) -> None:
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    results = {}
    for schedule, virtual in [(name, v) for name, v in SCHEDULES if name in args.schedules]:
        num_stages = ranks * virtual
        stage_ids = PipelineLayout(num_layers=num_stages, pipeline_parallel_size=ranks, virtual_pipeline_size=virtual,
                                   schedule=schedule).stages_of_rank(rank)
        recorder = TimelineRecorder(rank)
        runner = PipelineRunner(
            [SyntheticStage(args.stage_ms / 1e3 / virtual) for _ in stage_ids], stage_ids, num_stages=num_stages,
            group=dist.group.WORLD, device=torch.device("cpu"), schedule=schedule, micro_batch_size=1,
            root=SyntheticModel(), recorder=recorder,
        )
        inputs = torch.ones(args.micro_batches, 8)
        labels = torch.zeros(args.micro_batches, dtype=torch.long)
        runner.loss(inputs, labels)  # warm-up: shape inference and buffers
        dist.barrier()
        recorder.active = True
        runner.loss(inputs, labels)
        recorder.active = False
        gathered = [None] * ranks
        dist.all_gather_object(gathered, recorder.events)
        events = [e for part in gathered for e in part]
        if rank == 0:
            results[f"{schedule} v{virtual}"] = {
                "schedule": schedule,
                "virtual": virtual,
                "measured": measured_bubble(events),
                "theory": schedule_theory(schedule, recorder, ranks, args.micro_batches, virtual),
            }
            if args.plot and schedule == args.plot_schedule:
                render(events, Path(args.plot), title=f"{schedule}, pp={ranks}, vpp={virtual}",
                       theory=results[f"{schedule} v{virtual}"]["theory"])
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier()
    # Every rank is done and the results are written: leave without tearing the gloo group down. A group destroyed
    # while its peer is exiting can abort in native code ("terminate called without an active exception"; seen
    # once on a loaded 2-core machine), which would fail a run whose table is complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--stage-ms", type=float, default=20.0, help="forward time of one rank's stages per micro-batch")
    parser.add_argument("--plot", default="", help="write the timeline of --plot-schedule to this PNG")
    parser.add_argument("--plot-schedule", default="1f1b")
    parser.add_argument("--schedules", nargs="+", default=sorted({name for name, _ in SCHEDULES}),
                        choices=sorted({name for name, _ in SCHEDULES}), help="the schedules to run (default: all)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bubble.json"
        command = torchrun(args.ranks, __spec__.name, "--worker", f"--out={out}", f"--micro-batches={args.micro_batches}",
                           f"--stage-ms={args.stage_ms}", f"--plot={args.plot}", f"--plot-schedule={args.plot_schedule}",
                           "--schedules", *args.schedules)
        subprocess.run(command, check=True, env=worker_env())
        results = json.loads(out.read_text())
    print(f"pipeline bubble, p={args.ranks}, m={args.micro_batches}, stage forward {args.stage_ms} ms, backward 2x")
    print(f"{'schedule':<25}{'v':>3}{'measured':>11}{'theory':>9}{'diff (points)':>15}")
    for row in results.values():
        diff = 100 * (row["measured"] - row["theory"])
        print(f"{row['schedule']:<25}{row['virtual']:>3}{row['measured']:>11.1%}{row['theory']:>9.1%}{diff:>+15.1f}")


if __name__ == "__main__":
    main()
