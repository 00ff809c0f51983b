"""``lightning-megatron simulate``: run a config's real training step for chosen ranks of an N-GPU job on this CPU.

    lightning-megatron simulate --config configs/llama-3.1-8b.yaml --gpus 64
    lightning-megatron simulate --config configs/gpt3-175b.yaml --gpus 1024 --ranks 0,last --json

Each rank's set-up and two optimizer steps run in this process on fake tensors over torch's fake process group
(``lightning_megatron.simulate``): the strategy's own code, every micro-batch, the gradient reduction, the clip,
the optimizer and the checkpoint's shard plan. Printed per rank: its peak memory by category beside the planner's
prediction for that rank, the collectives of a step per group with their bytes, and what the simulation itself
took. By default the ranks that differ are simulated (``simulate.report.ranks_that_differ``); ``--ranks`` names
others (``first``, ``last`` or numbers). ``--json`` prints ``{"ranks": [{"rank", "simulated_peak_bytes",
"planned_peak_bytes", ...}]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import yaml

from lightning_megatron.commands.plan import simulate_config
from lightning_megatron.plan.hardware import parse_gpu
from lightning_megatron.simulate.report import format_report, to_json


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-megatron simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="a lightning-megatron fit config (YAML)")
    parser.add_argument("--gpus", type=int, help="GPUs in all (default: the config's devices x num_nodes)")
    parser.add_argument("--gpu", default="a100", help="the GPU the planner's prediction is for (as for plan)")
    parser.add_argument("--ranks", help="comma list of ranks to simulate: numbers, first, last (default: the ranks "
                                        "that differ: first and last pipeline stage; without pipelining the last "
                                        "data-parallel rank; with experts an expert-parallel rank)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    try:
        config = yaml.safe_load(args.config.read_text())
        trainer = config.get("trainer") or {}
        gpus = args.gpus or int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))
        results = simulate_config(config, gpus=gpus, hardware=parse_gpu(args.gpu), ranks=args.ranks,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, TypeError, OSError, yaml.YAMLError) as error:
        raise SystemExit(f"lightning-megatron simulate: {error}") from None
    if args.json:
        print(json.dumps(to_json(results), indent=1))
    else:
        print(f"{args.config.name} on {gpus} GPUs, simulated:")
        print(format_report(results))
