"""Time and bytes to initialise one rank's shard of a large weight, drawn as before (the full tensor, then cut) and
as now (``parallel.initialize``: only the shard's values, bit-identical), side by side; and a layer stack
initialised by ``initialize_parameters`` on 1 thread and on every core (several parameters drawn at once).

The shard is that of a ``--size`` x ``--size`` weight (default 8192, Llama-3-8B's hidden size) at tp ``--tp``
(default 8): a column-parallel (rows) shard at the first and the last tp rank (the last skips the most numbers)
and a row-parallel (columns) one. Bytes: the tensor data each draw allocates (summed over its allocations, from
torch's dispatcher; the host has no allocator statistics). All on the CPU; a CUDA run draws the same numbers on
the host and copies the shard.

Run: ``python benchmarks/init_shard.py [--size 8192] [--tp 8] [--layers 8]``
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "workers"))
from allocation_meter import AllocationMeter  # noqa: E402
from lightning_megatron.parallel.initialize import (default_initializer, initialize_parameters,  # noqa: E402
                                                     local_initial_values, parameter_seed)
from lightning_megatron.parallel.shards import TensorShard  # noqa: E402

SEED, NAME = 1234, "blocks.0.mlp.fc.weight"


def before(shard: TensorShard) -> torch.Tensor:
    """What ``local_initial_values`` did: the full parameter drawn with its generator, this rank's part cut out."""
    full = torch.empty(shard.global_shape)
    default_initializer(NAME, full, torch.Generator().manual_seed(parameter_seed(SEED, NAME)))
    return shard.local_slice(full)


def after(shard: TensorShard) -> torch.Tensor:
    param = nn.Parameter(torch.empty(shard.local_shape, device="meta"))
    param.tensor_shard = shard
    return local_initial_values(param, NAME, SEED, default_initializer)


def measure(draw, shard):
    with AllocationMeter() as meter:
        start = time.perf_counter()
        values = draw(shard)
        seconds = time.perf_counter() - start
    return values, seconds, meter.bytes


def stack_seconds(size: int, tp: int, layers: int, threads: int) -> float:
    """``initialize_parameters`` of ``layers`` column shards (size/tp x size each) on ``threads`` threads."""
    torch.set_num_threads(threads)
    stack = nn.Module()
    for index in range(layers):
        param = nn.Parameter(torch.empty(size // tp, size, device="meta"))
        param.tensor_shard = TensorShard(0, (size, size), size, tp - 1, tp)
        stack.register_parameter(f"w{index}", param)
    start = time.perf_counter()
    initialize_parameters(stack, SEED)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    cores = torch.get_num_threads()
    torch.set_num_threads(1)
    print(f"{args.size} x {args.size} fp32 weight at tp{args.tp} ({4 * args.size ** 2 / 2 ** 20:.0f} MiB full, "
          f"{4 * args.size ** 2 / args.tp / 2 ** 20:.0f} MiB a shard), one thread")
    print(f"{'shard':<26}{'before s':>10}{'after s':>10}{'before MiB':>12}{'after MiB':>11}  same values")
    for label, dim, rank in [("rows, first tp rank", 0, 0), ("rows, last tp rank", 0, args.tp - 1),
                             ("columns, last tp rank", 1, args.tp - 1)]:
        shard = TensorShard(dim, (args.size, args.size), args.size, rank, args.tp)
        old, old_s, old_b = measure(before, shard)
        new, new_s, new_b = measure(after, shard)
        print(f"{label:<26}{old_s:>10.2f}{new_s:>10.2f}{old_b / 2 ** 20:>12.0f}{new_b / 2 ** 20:>11.0f}  "
              f"{torch.equal(old, new)}")
    one = stack_seconds(args.size, args.tp, args.layers, 1)
    every = stack_seconds(args.size, args.tp, args.layers, cores)
    print(f"{args.layers} such shards by initialize_parameters: {one:.2f} s on 1 thread, {every:.2f} s on {cores} "
          f"threads ({one / every:.1f}x)")


if __name__ == "__main__":
    main()
