"""The 'nvme' optimizer tier against the 'cpu' one: host memory, step time, disk traffic, and the same run.

One GPT, data and AdamW, trained through ``Megatron3DStrategy`` for a few steps with a sharded checkpoint halfway,
in fresh processes (a high-water mark of memory belongs to one run only):

* ``cpu``:  ``offload_optimizer="cpu"``: fp32 main parameters and AdamW's state in host memory;
* ``nvme``: ``offload_optimizer="nvme"``: both in files under ``--path``, stepped through a pool of host buffers;
* ``nvme-resumed``: the ``nvme`` run again from its own halfway checkpoint;
* ``cpu-from-nvme``: the ``cpu`` tier resumed from the ``nvme`` run's checkpoint (a checkpoint made with one tier
  loads with the other).

Memory is the private resident set (``RssAnon`` of ``/proc/self/status``: not the page cache, where the files'
pages live), sampled every 2 ms by a thread, as growth over its value before the first forward (the model, its
gradient buffers and, for ``cpu``, the fp32 main copies exist then), by phase: forward + backward (the model's
activations and transient gradients, the same on every tier), the optimizer step (over its value when the step
starts), what stays after the step, and the checkpoint saves. The tier's growth is the largest of the last three.
The claim checked: the fp32 optimizer state (main parameters, exp_avg, exp_avg_sq: 12 bytes per parameter) is at
least 3x the growth allowed to the 'nvme' tier (its buffer pool plus ``--headroom-mb`` of allocator slack), and
the tier's measured growth stays within it. Disk traffic per step is counted twice: the bytes the
tier asked to move (exactly 2x the state: every tile read once and written once) and the block-device bytes of
``/proc/self/io`` (``read_bytes``/``write_bytes``: reads served by the page cache are not counted there, writes
are counted when the pages are dirtied). Step times are medians after the first step; the ratio is nvme / cpu.

Example::

    python -m benchmarks.offload                      # ~40M parameters, ~3 minutes on 2 CPU cores
    python -m benchmarks.offload --path /mnt/nvme/offload --hidden 1024 --layers 12
    python -m benchmarks.offload --accelerator gpu --path /mnt/nvme/offload   # PCIe in the loop (not yet measured)
    python -m benchmarks.offload --smoke              # a tiny model, for the test suite
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness.launch import run_checked, worker_env
from benchmarks.harness.tables import MIB


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="training steps; the checkpoint is taken at half")
    p.add_argument("--buffer-mb", type=float, default=4.0, help="offload_buffer_mb: one tile of one stream")
    p.add_argument("--headroom-mb", type=float, default=64.0,
                   help="growth allowed to the nvme tier beyond its buffer pool (allocator slack)")
    p.add_argument("--accelerator", default="cpu", help="the Trainer's: 'gpu' moves gradients and parameters over PCIe")
    p.add_argument("--path", default=None, help="offload_path (default: a temporary folder on this machine's disk)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model, two runs at a time (the test suite's run: its step times mean nothing)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.vocab, args.steps, args.buffer_mb = 64, 2, 4, 1000, 4, 0.01
    return args


# ---------------------------------------------------------------------------- one run (a child process)
def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def block_io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


class PeakSampler:
    """The highest ``RssAnon`` seen since :meth:`reset`, sampled by a daemon thread every 2 ms."""

    def __init__(self) -> None:
        self.peak = rss_anon()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.002)

    def reset(self) -> int:
        self.peak = rss_anon()
        return self.peak


def child(options: dict) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, Subset

    from benchmarks.harness.training import SyntheticTokens
    from lightning_megatron import Megatron3DStrategy
    from lightning_megatron.models import GPT, GPTConfig

    out = Path(options["out"])
    sampler = PeakSampler()
    record = {"losses": [], "step_s": [], "optimizer_s": [], "tier_read": [], "tier_written": [], "block_read": [],
              "block_written": []}

    class Measure(L.Callback):
        """RssAnon growth by phase, over the value before the first forward: forward + backward (the model's
        activations: the same on every tier), the optimizer step (over the value it started at), what stays after
        the step, and the checkpoint saves (between steps)."""

        def on_train_start(self, trainer, pl_module):
            main = trainer.strategy.driver.main_params
            record["params"] = sum(p.numel() for p in pl_module.parameters())
            record["pool_bytes"] = main.nvme.pool_bytes if main.nvme is not None else 0
            record["baseline"] = sampler.reset()

        def _files(self, trainer):
            return getattr(trainer.strategy.driver.main_params.nvme, "files", None)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            record["save_peak"] = max(record.get("save_peak", 0), sampler.peak)  # the save after the last step
            sampler.reset()
            self.started, self.io = time.perf_counter(), block_io()
            files = self._files(trainer)
            self.moved = (files.bytes_read, files.bytes_written) if files is not None else (0, 0)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            record["forward_backward_peak"] = max(record.get("forward_backward_peak", 0), sampler.peak)
            self.optimizer_started, self.optimizer_rss = time.perf_counter(), sampler.reset()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now, io = time.perf_counter(), block_io()
            record["optimizer_growth"] = max(record.get("optimizer_growth", 0), sampler.peak - self.optimizer_rss)
            record["after_step"] = rss_anon()
            sampler.reset()
            record["losses"].append(float(outputs["loss"]))
            record["step_s"].append(now - self.started)
            record["optimizer_s"].append(now - self.optimizer_started)
            record["block_read"].append(io[0] - self.io[0])
            record["block_written"].append(io[1] - self.io[1])
            files = self._files(trainer)
            if files is not None:
                record["tier_read"].append(files.bytes_read - self.moved[0])
                record["tier_written"].append(files.bytes_written - self.moved[1])

        def on_train_end(self, trainer, pl_module):
            record["save_peak"] = max(record.get("save_peak", 0), sampler.peak)

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=options["vocab"], max_seq_length=options["seq"], hidden_size=options["hidden"],
                       num_layers=options["layers"], num_heads=options["heads"])
    module = GPT(config, warmup_steps=options["steps"])
    # One sequence, repeated: every batch is the same whatever order the (shuffling) sampler picks, so a run resumed
    # halfway, whose epoch starts again, sees what the straight run saw.
    sample = SyntheticTokens(1, options["seq"], options["vocab"], seed=1)
    data = DataLoader(Subset(sample, [0] * (options["steps"] * options["batch"])), batch_size=options["batch"])
    tier = options["tier"]
    strategy = Megatron3DStrategy(offload_optimizer=tier, offload_path=options["path"] if tier == "nvme" else None,
                                  offload_buffer_mb=options["buffer_mb"])
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=options["steps"] // 2, save_top_k=-1)
    trainer = L.Trainer(accelerator=options["accelerator"], devices=1, strategy=strategy, max_steps=options["steps"],
                        callbacks=[Measure(), checkpoint], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, gradient_clip_val=1.0)
    trainer.fit(module, train_dataloaders=data, ckpt_path=options.get("resume"))
    torch.save(trainer.strategy.full_state_dict(), out / "weights.pt")
    (out / "record.json").write_text(json.dumps(record))


# ---------------------------------------------------------------------------- the parent
def run(name: str, args: argparse.Namespace, work: Path, path: str, tier: str, resume=None) -> dict:
    out = work / name
    out.mkdir()
    options = {**{k: getattr(args, k) for k in ("hidden", "layers", "heads", "vocab", "seq", "batch", "steps",
                                                "buffer_mb", "accelerator")},
               "tier": tier, "path": path, "out": str(out), "resume": resume}
    run_checked([sys.executable, "-m", __spec__.name, "--child", json.dumps(options)], f"run {name}", env=worker_env(threads=0))
    return {**json.loads((out / "record.json").read_text()), "out": out}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return {}
    import torch

    with tempfile.TemporaryDirectory(prefix="offload-bench-") as scratch:
        work = Path(scratch)
        path = args.path or str(work / "offload")
        half = f"checkpoints/epoch=0-step={args.steps // 2}.ckpt"
        # --smoke times nothing it reports on: its runs go two at a time (cpu with nvme, then the two resumptions,
        # each pair independent), using a core the other would leave idle; a measurement runs one at a time.
        with ThreadPoolExecutor(2 if args.smoke else 1) as runner:
            runs = {name: future.result() for name, future in [
                ("cpu", runner.submit(run, "cpu", args, work, path, "cpu")),
                ("nvme", runner.submit(run, "nvme", args, work, path, "nvme"))]}
            halfway = str(runs["nvme"]["out"] / half)
            runs |= {name: future.result() for name, future in [
                ("nvme-resumed", runner.submit(run, "nvme-resumed", args, work, path, "nvme", resume=halfway)),
                ("cpu-from-nvme", runner.submit(run, "cpu-from-nvme", args, work, path, "cpu", resume=halfway))]}
        weights = {name: torch.load(r["out"] / "weights.pt", weights_only=True) for name, r in runs.items()}
        leftovers = sorted(str(p) for p in Path(path).rglob("*")) if Path(path).exists() else []

    params = runs["cpu"]["params"]
    state_bytes = 12 * params  # fp32 main parameters, exp_avg, exp_avg_sq
    allowed = runs["nvme"]["pool_bytes"] + int(args.headroom_mb * MIB)
    later = slice(1, None)  # the first step makes the state (and, on the cpu tier, allocates it)
    report = {"parameters": params, "state_bytes": state_bytes, "allowed_growth": allowed,
              "state_over_allowed": state_bytes / allowed, "leftover_files": leftovers, "runs": {}}
    print(f"GPT {params / 1e6:.1f}M parameters: fp32 optimizer state {state_bytes / MIB:.0f} MiB; 'nvme' pool "
          f"{runs['nvme']['pool_bytes'] / MIB:.0f} MiB + {args.headroom_mb:.0f} MiB headroom = growth allowed to the "
          f"tier {allowed / MIB:.0f} MiB (state / allowed = {state_bytes / allowed:.1f}x)\n")
    print("RssAnon growth over the value before the first forward, by phase (MiB); the tier's = the largest of the "
          "optimizer step's, after-step and save columns")
    header = (f"{'run':<14} {'fwd+bwd':>8} {'opt step':>9} {'after step':>11} {'saves':>7} {'tier':>7} "
              f"{'step ms':>8} {'opt ms':>7} {'vs cpu':>7} {'tier r/w per step':>18} {'disk r/w per step':>18} "
              f"{'|loss - cpu|':>13} {'|w - cpu|':>10}")
    print(header)
    print("-" * len(header))
    median = lambda values: statistics.median(values[later] if len(values) > 1 else values) if values else 0  # noqa: E731
    cpu_step = median(runs["cpu"]["step_s"])
    for name, r in runs.items():
        base = r["baseline"]
        growth = {"forward_backward": r["forward_backward_peak"] - base, "optimizer": r["optimizer_growth"],
                  "after_step": r["after_step"] - base, "saves": r["save_peak"] - base}
        tier = max(growth["optimizer"], growth["after_step"], growth["saves"])
        reference = runs["cpu"]["losses"][-len(r["losses"]):]
        row = {**growth, "tier": tier, "step_ms": 1e3 * median(r["step_s"]), "optimizer_ms": 1e3 * median(r["optimizer_s"]),
               "vs_cpu": median(r["step_s"]) / cpu_step, "tier_read": median(r["tier_read"]),
               "tier_written": median(r["tier_written"]), "block_read": median(r["block_read"]),
               "block_written": median(r["block_written"]),
               "loss_dev": max(abs(a - b) for a, b in zip(r["losses"], reference)),
               "weight_dev": max((weights[name][k] - weights["cpu"][k]).abs().max().item() for k in weights["cpu"])}
        report["runs"][name] = row
        mib = lambda key: row[key] / MIB  # noqa: E731
        print(f"{name:<14} {mib('forward_backward'):>8.0f} {mib('optimizer'):>9.0f} {mib('after_step'):>11.0f} "
              f"{mib('saves'):>7.0f} {mib('tier'):>7.0f} {row['step_ms']:>8.0f} {row['optimizer_ms']:>7.0f} "
              f"{row['vs_cpu']:>6.2f}x {mib('tier_read'):>8.0f} / {mib('tier_written'):<7.0f} "
              f"{mib('block_read'):>8.0f} / {mib('block_written'):<7.0f} {row['loss_dev']:>13.1e} {row['weight_dev']:>10.1e}")
    nvme = report["runs"]["nvme"]
    print(f"\n'nvme': the tier moved {nvme['tier_read'] / state_bytes:.2f}x (read) + {nvme['tier_written'] / state_bytes:.2f}x "
          f"(written) the state per step; its RssAnon growth {nvme['tier'] / MIB:.0f} MiB is "
          f"{'within' if nvme['tier'] <= allowed else 'OVER'} the allowed {allowed / MIB:.0f} MiB "
          f"(the cpu tier's: {report['runs']['cpu']['tier'] / MIB:.0f} MiB); files left after the runs: {len(leftovers)}")
    return report


if __name__ == "__main__":
    main()
