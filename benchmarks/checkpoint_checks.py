"""What the checkpoint safety checks cost: checksums at save, verification and the finite check at load.

One process writes the same tensors (fp32, ``--megabytes`` in all, in tensors of a transformer
layer's sizes) as a sharded checkpoint with ``checksums=False`` and ``checksums=True`` (the strategy's
default, ``checkpoint_checksums=True``; loading compares them by default), side by side
and alternating, then times ``verify_checksums`` over the files, a plain read of every tensor, and
the finite check (``nonfinite_names``) over what was read. The table shows the median of
``--repeats`` rounds and, for each check, its cost per GB and against the plain save or read. The
files are hot in the page cache, so the CRC-32 figure is the cost of the sum itself; a cold read
from disk adds the disk's read time (the save had to write those bytes anyway).

Example::

    python benchmarks/checkpoint_checks.py                       # 512 MB, 3 rounds
    python benchmarks/checkpoint_checks.py --megabytes 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lightning_megatron.checkpoint.sharded import open_sharded, read_full_tensors, save_sharded, verify_checksums
from lightning_megatron.checkpoint.training_state import nonfinite_names


def make_tensors(megabytes: float, hidden: int = 1024) -> dict[str, torch.Tensor]:
    """fp32 tensors of a transformer layer's shapes (qkv, proj, fc, fc2) until ``megabytes`` are reached."""
    tensors, total, layer = {}, 0, 0
    shapes = {"qkv": (3 * hidden, hidden), "proj": (hidden, hidden), "fc": (4 * hidden, hidden), "fc2": (hidden, 4 * hidden)}
    generator = torch.Generator().manual_seed(0)
    while total < megabytes * 1e6:
        for name, shape in shapes.items():
            tensors[f"state_dict/layers.{layer}.{name}.weight"] = torch.randn(shape, generator=generator)
            total += shape[0] * shape[1] * 4
        layer += 1
    return tensors


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    tensors = make_tensors(args.megabytes)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    root = Path(args.out_dir or tempfile.mkdtemp(prefix="checkpoint_checks_"))
    root.mkdir(parents=True, exist_ok=True)
    info = {"model": "benchmark", "layout": {}, "world_size": 1}
    times: dict[str, list[float]] = {name: [] for name in ("save", "save+checksums", "read", "verify", "finite")}
    for repeat in range(args.repeats):
        order = [False, True] if repeat % 2 == 0 else [True, False]  # alternate: drift falls on both alike
        for checksums in order:
            target = root / f"{'with' if checksums else 'without'}.ckpt"
            times["save+checksums" if checksums else "save"].append(
                timed(lambda: save_sharded(target, tensors, {}, info, checksums=checksums)))
        saved = open_sharded(root / "with.ckpt")
        times["verify"].append(timed(lambda: verify_checksums(saved)))
        read: dict = {}
        times["read"].append(timed(lambda: read.update(read_full_tensors(root / "with.ckpt"))))
        times["finite"].append(timed(lambda: nonfinite_names(read)))
    median = {name: statistics.median(values) for name, values in times.items()}
    gigabytes = size / 1e9
    print(f"{len(tensors)} fp32 tensors, {size / 1e6:,.0f} MB, median of {args.repeats} rounds, files in {root}")
    print(f"{'step':<38} | {'seconds':>8} | {'s per GB':>8} | {'MB/s':>7} | {'vs baseline':>11}")
    rows = [
        ("save, no checksums (baseline)", median["save"], median["save"]),
        ("save with checksums", median["save+checksums"], median["save"]),
        ("  of which the checksums", median["save+checksums"] - median["save"], median["save"]),
        ("read every tensor (baseline)", median["read"], median["read"]),
        ("verify every file's checksum", median["verify"], median["read"]),
        ("load with verification (read + verify)", median["read"] + median["verify"], median["read"]),
        ("finite check of what was read", median["finite"], median["read"]),
    ]
    for label, seconds, baseline in rows:
        print(f"{label:<38} | {seconds:>8.3f} | {seconds / gigabytes:>8.3f} | {size / 1e6 / seconds:>7,.0f} | "
              f"{seconds / baseline:>10.2f}x")
    if args.out_dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
