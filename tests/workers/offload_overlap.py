"""A 16-bit model whose fp32 optimizer is offloaded to the host, trained on or off the data-parallel group, with the
order of its buckets' reduction launches and of the copies into the host staging tensors recorded: helpers for
test_offload.py, and run under torchrun (argv: OUT_DIR) it trains over 2 ranks at ZeRO 0 and 1, where each copy
waits for its bucket's collective, and rank ``r`` writes ``rank{r}.json``: whether the offloaded weights equal the
ones stepped on the device bit for bit, and whether the first bucket's copy was issued before the last launch."""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_megatron.offload.settings import OffloadSettings
from lightning_megatron.optim.grad_sync import GradientSynchronizer
from lightning_megatron.optim.main_params import MainParamOptimizer


class _StagingCopies(TorchDispatchMode):
    """Appends ``("copy", storage)`` to ``events`` for every copy into one of ``storages`` (the host staging
    tensors), in the order the ops run."""

    def __init__(self, storages: set[int], events: list) -> None:
        super().__init__()
        self.storages, self.events = storages, events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].untyped_storage().data_ptr() in self.storages:
            self.events.append(("copy", args[0].untyped_storage().data_ptr()))
        return func(*args, **(kwargs or {}))


def train_recording(tier, zero_stage, group=None, steps=3, micro_batches=2):
    """A 16-bit model stepped by AdamW on fp32 main pieces (offloaded to the host with ``tier="cpu"``), one
    parameter a bucket, ``micro_batches`` backward passes a step; returns the weights and, for the last step, the
    order of the buckets' reduction launches and the copies into the host staging tensors."""
    rank = 0 if group is None else dist.get_rank(group)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    model = model.to(torch.bfloat16)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    sync = GradientSynchronizer(params, data_parallel_group=group, bucket_size_mb=1e-6, zero_stage=zero_stage)
    main = MainParamOptimizer(optimizer, sync, offload=OffloadSettings(tier))
    events = []
    launch = sync._launch
    number = {id(bucket): i for i, bucket in enumerate(sync.buckets)}

    def recorded_launch(bucket):
        events.append(("launch", number[id(bucket)]))
        launch(bucket)

    sync._launch = recorded_launch
    staging = main.staging
    storages = {t.untyped_storage().data_ptr() for t in staging.homes + staging.reduced_homes if t is not None}
    for step in range(steps):
        events.clear()
        with _StagingCopies(storages, events):
            for micro_batch in range(micro_batches):
                sync.start_micro_batch(sync=micro_batch == micro_batches - 1)
                seed = step * 10 + micro_batch + 100 * rank
                inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
                model(inputs.to(torch.bfloat16)).float().pow(2).sum().backward()
            sync.finish(torch.tensor(12.0))  # a normaliser that changes the values: 1/(12 x replicas)
            main.prepare_step()
        optimizer.step()
        main.finish_step()
        sync.zero()
    home_of_bucket = {}
    for index, (piece, _) in enumerate(main.pieces):
        home = staging.reduced_homes[index] if staging.reduced_homes[index] is not None else staging.homes[index]
        if home is not None:
            home_of_bucket.setdefault(number[id(piece.bucket)], home.untyped_storage().data_ptr())
    main.remove()
    sync.remove()
    return [p.detach().clone() for p in model.parameters()], events, home_of_bucket


def copied_before_last_launch(events: list, home_of_bucket: dict) -> bool:
    """Whether the copy of the first bucket whose reduction was launched came before the last launch."""
    launches = [i for i, (kind, _) in enumerate(events) if kind == "launch"]
    first_copy = events.index(("copy", home_of_bucket[events[launches[0]][1]]))
    return len(launches) == len(home_of_bucket) > 2 and first_copy < launches[-1]


def main(out_dir: Path, args: list[str]) -> None:
    result = {}
    for zero_stage in (0, 1):
        on_device, _, _ = train_recording("none", zero_stage, dist.group.WORLD)
        offloaded, events, home_of_bucket = train_recording("cpu", zero_stage, dist.group.WORLD)
        result[f"z{zero_stage}"] = {"equal": all(torch.equal(a, b) for a, b in zip(on_device, offloaded)),
                                    "copied_early": copied_before_last_launch(events, home_of_bucket)}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    from entry import run_script  # here: tests/test_offload.py imports this module as workers.offload_overlap

    run_script(main)
