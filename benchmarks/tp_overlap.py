"""What ``tp_comm_overlap`` buys: training-step time with the sequence-parallel collectives overlapped, and without.

One invocation, one table. The tp ranks (``torchrun``, gloo on CPU or NCCL on CUDA) each build, from the same
seed, the same GPT three times over the same sequence-parallel layout as the strategy builds it
(``parallelize`` with the model's plan, ``build_step_gradients``): with the linears communicating in turn (off,
the default), with ``tensor_parallel.overlap.OverlappedSequenceParallelLinear()`` (what ``tp_comm_overlap=True``
gives) and with its row layers also cut in ``--row-chunks`` pieces. All three train in lockstep on the same
batches with AdamW, ``--steps`` steps per round, the variants interleaved round by round (reversed every other
round) so that drift on a shared machine falls on each alike. A step's time is the slowest rank's; a run's, the
median over its steps; the table shows the best round (noise only ever slows a run down) and the range of the
per-round on/off ratios. ``max loss diff``: the largest difference between a variant's loss and the baseline's
at the same step, over every step run (the overlap only reorders fp32 sums inside GEMMs: ~1e-6 or less).

What to expect: on CUDA the backward overlaps hide the input re-gather and the input-gradient reduce-scatter
behind GEMMs. On CPU gloo runs a collective on its own thread, so overlap is possible, but the GEMMs and gloo
share the same few cores (and on a machine shared with other jobs, fewer): read the ratios with the per-round
range next to them. ``--clock cpu`` times the CPU seconds each process used instead (all its threads, gloo's
included), which other jobs cannot inflate: it cannot show time hidden by overlap, only the work the overlap
adds (its extra all-gather and copies).

Example::

    python benchmarks/tp_overlap.py                  # CPU, tp=2, GPT and Llama shapes; a few minutes on 2 cores
    python benchmarks/tp_overlap.py --quick          # a smoke test
    python benchmarks/tp_overlap.py --device cuda --tp 4 --hidden 4096 --seq 4096 --batch 2 --layers 4

``run(Settings(...))`` returns the table (for a registry of overlap measurements); ``main()`` is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lightning_megatron.models import GPTConfig, GPTModel
from lightning_megatron.optim.nonfinite import NonFiniteCheck
from lightning_megatron.optim.step import build_step_gradients
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.tensor_parallel import parallelize
from lightning_megatron.tensor_parallel.overlap import OverlappedSequenceParallelLinear
from throughput import REPO_ROOT, format_rows

OFF = "off"
CHOICES = {"device": ("cpu", "cuda"), "clock": ("wall", "cpu")}


@dataclass
class Settings:
    models: tuple[str, ...] = ("gpt", "llama")
    tp: int = 2
    hidden: int = 256
    layers: int = 2
    heads: int = 8
    seq: int = 256
    batch: int = 4
    vocab: int = 1024
    row_chunks: int = 2
    steps: int = 8
    warmup: int = 2
    repeats: int = 3
    device: str = "cpu"
    threads: int = 1
    clock: str = "wall"  # "cpu": the CPU seconds each process used (all its threads), which other jobs cannot inflate
    seed: int = 1234

    def variants(self) -> dict[str, int]:
        """Variant name -> row_chunks of its overlap (0: off)."""
        return {OFF: 0, "tp_comm_overlap": 1, f"tp_comm_overlap, row_chunks={self.row_chunks}": self.row_chunks}


def model_config(settings: Settings, model: str) -> GPTConfig:
    if model == "llama":  # RMSNorm, rotary, SwiGLU (PackedColumn), grouped-query qkv (QueryGroupColumn)
        return GPTConfig.from_name("llama-tiny", vocab_size=settings.vocab, max_seq_length=settings.seq,
                                   hidden_size=settings.hidden, num_layers=settings.layers, num_heads=settings.heads,
                                   num_query_groups=max(1, settings.heads // 2),
                                   ffn_hidden_size=settings.hidden * 11 // 4)
    return GPTConfig(vocab_size=settings.vocab, max_seq_length=settings.seq, hidden_size=settings.hidden,
                     num_layers=settings.layers, num_heads=settings.heads)


class Trainee:
    """One variant's model, optimizer and gradient path on this rank, as the strategy builds them."""

    def __init__(self, settings: Settings, model: str, row_chunks: int, state: ParallelState,
                 device: torch.device) -> None:
        with torch.device("meta"):
            self.model = GPTModel(model_config(settings, model))
        overlap = OverlappedSequenceParallelLinear(row_chunks) if row_chunks else None
        rng = TensorParallelRNG(settings.seed, state.tensor_parallel_rank, device)
        parallelize(self.model, self.model.tensor_parallel_plan(), state, rng=rng, sequence_linear=overlap)
        initialize_parameters(self.model, settings.seed, device=device, only_meta=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.step = build_step_gradients(self.model, state, [self.optimizer], loss_scaler=None,
                                         nonfinite=NonFiniteCheck("ignore", 10), bucket_size_mb=25.0, offload=False,
                                         device=device)

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        self.step.sync.start_micro_batch(sync=True)
        loss_sum, tokens = self.model.loss(input_ids, labels)
        (loss_sum * self.step.backward_scale(tokens, accumulation=1, loss_scale=1.0)).backward()
        self.step.add_tokens(tokens)
        self.step.finish(accumulation=1, loss_scale=1.0)
        self.optimizer.step()
        self.step.after_step()
        return (loss_sum.detach() / tokens).item()  # a host synchronisation: the step is done


def _now(device: torch.device, clock: str) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time() if clock == "cpu" else time.perf_counter()


def worker(settings: Settings, result_dir: Path) -> None:
    """Every model's variants, ``repeats`` interleaved rounds each; rank r writes ``rank{r}.json``."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if settings.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    state = ParallelState.create(ParallelConfig(tensor_parallel_size=settings.tp, sequence_parallel=True), device)
    generator = torch.Generator().manual_seed(settings.seed)
    total = settings.warmup + settings.steps
    results: dict = {}
    for model in settings.models:
        trainees = {name: Trainee(settings, model, chunks, state, device)
                    for name, chunks in settings.variants().items()}
        batches = [torch.randint(0, settings.vocab, (settings.batch, settings.seq + 1), generator=generator)
                   for _ in range(total * settings.repeats)]
        runs = {name: {"seconds": [], "losses": []} for name in trainees}
        order = list(trainees)
        for repeat in range(settings.repeats):
            for name in order if repeat % 2 == 0 else order[::-1]:
                seconds, losses = [], []
                for tokens in batches[repeat * total:(repeat + 1) * total]:
                    tokens = tokens.to(device)
                    start = _now(device, settings.clock)
                    losses.append(trainees[name].train_step(tokens[:, :-1], tokens[:, 1:]))
                    seconds.append(_now(device, settings.clock) - start)
                runs[name]["seconds"].append(seconds[settings.warmup:])
                runs[name]["losses"].extend(losses)
        results[model] = runs
    (result_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def measure(settings: Settings) -> dict:
    """Launch the tp ranks; returns ``{model: {variant: {"rounds": [seconds], "losses": [...]}}}``, a round's
    seconds the median over its steps of the slowest rank's step time."""
    with tempfile.TemporaryDirectory(prefix="tp-overlap-") as tmp:
        result_dir = Path(tmp)
        settings_file = result_dir / "settings.json"
        settings_file.write_text(json.dumps(asdict(settings)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={settings.tp}",
               str(Path(__file__).resolve()), "--worker", str(settings_file)]
        env = dict(os.environ, PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        if settings.threads > 0:
            env["OMP_NUM_THREADS"] = str(settings.threads)
        proc = subprocess.run(cmd, env=env, cwd=result_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the benchmark worker failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}")
        ranks = [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(settings.tp)]
    out: dict = {}
    for model in settings.models:
        out[model] = {}
        for name in settings.variants():
            rounds = zip(*(rank[model][name]["seconds"] for rank in ranks))
            out[model][name] = {"rounds": [statistics.median(max(step) for step in zip(*run)) for run in rounds],
                                "losses": ranks[0][model][name]["losses"]}
    return out


def format_table(settings: Settings, results: dict) -> str:
    rows = [["variant", "step ms on", "step ms off", "ratio", "per-round ratios", "max loss diff"]]
    for model, runs in results.items():
        off = runs[OFF]
        for name in settings.variants():
            if name == OFF:
                continue
            on = runs[name]
            ratios = [a / b for a, b in zip(on["rounds"], off["rounds"])]
            diff = max(abs(a - b) for a, b in zip(on["losses"], off["losses"]))
            rows.append([f"{model} tp={settings.tp} {name}", f"{min(on['rounds']) * 1e3:.1f}",
                         f"{min(off['rounds']) * 1e3:.1f}", f"{min(on['rounds']) / min(off['rounds']):.3f}",
                         f"{min(ratios):.3f}-{max(ratios):.3f}", f"{diff:.1e}"])
    return format_rows(rows)


def describe(settings: Settings) -> str:
    return (f"tp_comm_overlap on vs off: sequence parallelism over tp={settings.tp} ranks, h={settings.hidden}, "
            f"{settings.layers} layers, {settings.heads} heads, seq={settings.seq}, batch={settings.batch}, "
            f"vocab={settings.vocab}, {settings.device} fp32, threads/process={settings.threads or 'default'}, "
            f"{settings.clock if settings.device == 'cpu' else 'wall'} clock, torch {torch.__version__}\n"
            f"step ms: median over {settings.steps} steps after {settings.warmup} warmup, slowest rank per step, best "
            f"of {settings.repeats} interleaved rounds. ratio: on / off (< 1: the overlap saves time).")


def run(settings: Settings) -> str:
    """The measurement, as the text printed: description and table."""
    return describe(settings) + "\n" + format_table(settings, measure(settings))


def parse_args(argv: Optional[list[str]] = None) -> tuple[Settings, Optional[Path]]:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in fields(Settings):
        value = getattr(defaults, field.name)
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, tuple):
            parser.add_argument(flag, nargs="+", default=list(value), choices=("gpt", "llama"))
        elif field.name in CHOICES:
            parser.add_argument(flag, default=value, choices=CHOICES[field.name])
        else:
            parser.add_argument(flag, type=type(value), default=value)
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny model, 2 steps, 1 round")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        saved = json.loads(args.worker.read_text())
        return Settings(**dict(saved, models=tuple(saved["models"]))), args.worker
    settings = Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)})
    settings.models = tuple(settings.models)
    if args.quick:
        settings = replace(settings, hidden=32, layers=1, heads=4, seq=16, batch=2, vocab=64, steps=2, warmup=1,
                           repeats=1)
    return settings, None


def main(argv: Optional[list[str]] = None) -> None:
    settings, worker_settings = parse_args(argv)
    if worker_settings is not None:
        worker(settings, worker_settings.parent)
        return
    print(run(settings))


if __name__ == "__main__":
    main()
