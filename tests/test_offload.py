"""The offload tiers in one process: the settings' checks, the 'nvme' tier's resource checks, and its tiled step
against the same optimizer stepping whole tensors in memory, and the host copies of the reduced gradients that start
in backward (multi-rank layouts: test_layout_invariance.py, test_sharded_checkpoint.py, test_precision.py,
test_fault_lifecycle.py; over 2 ranks here: workers/offload_overlap.py)."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.offload import OffloadSettings
from lightning_megatron.offload.files import OffloadFiles
from lightning_megatron.offload.nvme import available_memory, check_resources
from lightning_megatron.offload.tiled_step import TiledPiece, cut_into_tiles
from lightning_megatron.optim.grad_sync import GradientSynchronizer
from lightning_megatron.optim.main_params import MainParamOptimizer

from launch import run_job
from workers.offload_overlap import copied_before_last_launch, train_recording


@pytest.mark.parametrize("options, message", [
    ({"offload_optimizer": "disk"}, r"offload_optimizer='disk' is not one of \('none', 'cpu', 'nvme'\)"),
    ({"offload_optimizer": "nvme"}, "The 'nvme' offload tier keeps its files under offload_path"),
    ({"offload_optimizer": "cpu", "offload_path": "/tmp/x"}, "offload_path='/tmp/x' is only used by the 'nvme' tier"),
    ({"offload_parameters": "cpu", "zero_stage": 1}, "offload_parameters='cpu' offloads the sharded parameters of ZeRO-3"),
    ({"offload_optimizer": "cpu", "zero_stage": 3}, "with zero_stage=3: ZeRO-3's optimizer steps on its sharded"),
    ({"offload_parameters": "nvme", "zero_stage": 3}, "offload_parameters='nvme' .* is not supported"),
    ({"offload_optimizer": "nvme", "offload_path": "/tmp/x", "async_checkpoint": True},
     "async_checkpoint=True copies this rank's optimizer state into host memory"),
    ({"offload_optimizer": "nvme", "offload_path": "/tmp/x", "offload_buffer_mb": 0}, "offload_buffer_mb must be > 0"),
])
def test_offload_arguments_that_cannot_run_are_refused_when_the_strategy_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        Megatron3DStrategy(**options)


def test_true_still_means_cpu():
    assert Megatron3DStrategy(offload_optimizer=True).options.offload == OffloadSettings("cpu")
    assert Megatron3DStrategy(zero_stage=3, offload_parameters=True).options.offload.parameters == "cpu"


def test_a_disk_or_memory_too_small_is_refused_with_the_numbers(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match=r"needs .* per rank x 2 rank\(s\) on this machine = .* which has .* free"):
        check_resources(str(tmp_path), disk_bytes=free // 2 + 2**20, pool_bytes=1, ranks_sharing_host=2, rank=0)
    check_resources(str(tmp_path), disk_bytes=2**20, pool_bytes=1, ranks_sharing_host=2, rank=0)
    with pytest.raises(ValueError, match="buffer pool needs .* of host memory; .* is available. Lower offload_buffer_mb"):
        check_resources(str(tmp_path), disk_bytes=1, pool_bytes=available_memory() + 1, ranks_sharing_host=1, rank=3)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="Rank 0: offload_path=.* cannot be created"):
        check_resources(str(tmp_path / "file" / "below"), disk_bytes=1, pool_bytes=1, ranks_sharing_host=1, rank=0)


def test_files_move_exactly_the_bytes_asked_and_leave_nothing_behind(tmp_path):
    files = OffloadFiles(tmp_path, {"a": (10, torch.float32), "b": (0, torch.float32)}, prefix="t-")
    assert files.path("a").stat().st_size == 40
    files.write("a", 3, torch.arange(4.0))
    into = torch.empty(6)
    files.read("a", 2, into)
    assert into.tolist() == [0.0, 0.0, 1.0, 2.0, 3.0, 0.0]
    mapped = files.piece("a", 3, 4)
    assert mapped.tolist() == [0.0, 1.0, 2.0, 3.0]  # the mapping sees what was written
    assert mapped.untyped_storage().nbytes() == 16  # its storage is the range alone (saved without a copy)
    mapped.fill_(7.0)
    files.read("a", 0, into)
    assert into.tolist() == [0.0, 0.0, 0.0, 7.0, 7.0, 7.0]  # and what is written through it reaches the file
    assert (files.bytes_read, files.bytes_written) == (48, 16)
    files.close()
    assert list(tmp_path.iterdir()) == []


def test_tiles_cover_every_element_once():
    pieces = [TiledPiece(nn.Parameter(torch.zeros(n)), 0, start) for n, start in ((5, 0), (1, 5), (7, 6))]
    tiles = cut_into_tiles(pieces, 4)
    covered = [pieces[i].start + k for tile in tiles for i, lo, hi in tile.parts for k in range(lo, hi)]
    assert covered == list(range(13)) and [t.stop - t.start for t in tiles] == [4, 4, 4, 1]


OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2),
    "adamw-amsgrad-foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-2, amsgrad=True, foreach=True),
    "adam-fused": lambda groups: torch.optim.Adam(groups, lr=1e-2, fused=True),
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3),
}


def _train(tier, make_optimizer, dtype, tmp_path, tile_elements=37):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(dtype)
    params = list(model.parameters())
    optimizer = make_optimizer([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}])
    sync = GradientSynchronizer(params, data_parallel_group=None, bucket_size_mb=0.001, zero_stage=0)
    settings = OffloadSettings(tier, path=str(tmp_path) if tier == "nvme" else None, buffer_mb=tile_elements * 4 / 2**20)
    main = MainParamOptimizer(optimizer, sync, offload=settings)
    for step in range(4):
        sync.start_micro_batch(sync=True)
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).to(dtype)
        model(inputs).float().pow(2).sum().backward()
        sync.finish(torch.tensor(1.0))
        main.prepare_step()
        if step == 2:
            main.drop_grads()  # a skipped step: nothing may change
        optimizer.step()
        main.finish_step()
        sync.zero()
    state = {key: value.clone() for _, m in main.pieces for key, value in optimizer.state[m].items()}
    weights = [p.detach().clone() for p in model.parameters()]
    main.remove()
    return weights, state, main


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_tiled_step_equals_the_optimizer_stepping_whole_tensors(name, dtype, tmp_path):
    """Tiles of 37 elements cut pieces anywhere and span pieces and param groups; the first step creates the
    state inside the tiles, a piece spanning tiles has its step counter advanced once. Bit for bit, but for the
    fused kernel, whose vector loop and scalar tail round differently and fall elsewhere in a tile (~1e-8)."""
    in_memory, state_in_memory, _ = _train("cpu", OPTIMIZERS[name], dtype, tmp_path)
    tiled, state_tiled, main = _train("nvme", OPTIMIZERS[name], dtype, tmp_path)
    tolerance = 1e-7 if "fused" in name else 0.0
    assert all((a.float() - b.float()).abs().max() <= tolerance for a, b in zip(in_memory, tiled))
    assert state_in_memory.keys() == state_tiled.keys()
    assert all((state_in_memory[k].float() - state_tiled[k].float()).abs().max() <= tolerance for k in state_tiled)
    assert len(main.nvme.engine.tiles) > len(main.pieces) > 1
    # 16-bit gradients need fp32 host copies: in a file of their own, never in private memory.
    assert ("grad" in main.nvme.files.streams) == (dtype == torch.bfloat16)
    assert list(tmp_path.iterdir()) == []  # remove() deleted this tier's folder


def test_an_lr_scheduler_made_before_the_nvme_tier_sees_its_steps_without_a_warning(tmp_path, recwarn):
    """Lightning builds the scheduler with the optimizer, before the strategy adds the tier, which replaces the
    instance's step: the scheduler's first step must find its wrapper's mark and the step it noted (it warned
    "optimizer.step() has been overridden" on every 'nvme' run)."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    sync = GradientSynchronizer(list(model.parameters()), data_parallel_group=None, bucket_size_mb=0.001, zero_stage=0)
    main = MainParamOptimizer(optimizer, sync, offload=OffloadSettings("nvme", path=str(tmp_path)))
    sync.start_micro_batch(sync=True)
    model(torch.ones(2, 4)).sum().backward()
    sync.finish(torch.tensor(1.0))
    main.prepare_step()
    optimizer.step()
    main.finish_step()
    scheduler.step()
    main.remove()
    assert not [str(w.message) for w in recwarn if "lr_scheduler" in str(w.message) or "optimizer.step" in str(w.message)]
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_checkpoint_state_is_loaded_into_the_files(tmp_path):
    """``state_home``: where a checkpoint's optimizer state is read in place (the files, not fresh memory)."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    sync = GradientSynchronizer(list(model.parameters()), data_parallel_group=None, bucket_size_mb=0.001, zero_stage=0)
    main = MainParamOptimizer(optimizer, sync, offload=OffloadSettings("nvme", path=str(tmp_path)))
    piece = main.pieces[1][1]
    home = main.state_home(piece, "exp_avg")
    home.fill_(3.0)
    stream = torch.empty(main.nvme.files.streams["state.exp_avg"][0])
    main.nvme.files.read("state.exp_avg", 0, stream)
    assert home.shape == piece.shape and stream[-piece.numel():].eq(3.0).all() and stream[:-piece.numel()].eq(0).all()
    assert main.state_home(piece, "not_a_state") is None
    main.remove()


class _HostAllocations(TorchDispatchMode):
    """Bytes of new host storage that the ops run inside the block make (views and in-place results excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.bytes += sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                          and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in inputs)
        return out


def _host_bytes_per_step(tier, layers, tmp_path):
    """Host bytes the gradient hand-over (reduction, copies to the host pieces, write-back) makes in a step after
    the first; asserts that the host optimizer read its gradients from the same tensors every step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)]).to(torch.bfloat16)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    sync = GradientSynchronizer(params, data_parallel_group=None, bucket_size_mb=0.001, zero_stage=0)
    settings = OffloadSettings(tier, path=str(tmp_path) if tier == "nvme" else None)
    main = MainParamOptimizer(optimizer, sync, offload=settings)
    homes, allocated = [], []
    for step in range(3):
        sync.start_micro_batch(sync=True)
        model(torch.randn(4, 16).to(torch.bfloat16)).float().pow(2).sum().backward()
        with _HostAllocations() as before_step:
            sync.finish(torch.tensor(1.0))
            main.prepare_step()
        homes.append([m.grad for _, m in main.pieces])
        optimizer.step()  # the optimizer's own temporaries are not the hand-over's
        with _HostAllocations() as after_step:
            main.finish_step()
            sync.zero()
        allocated.append(before_step.bytes + after_step.bytes)
    main.remove()
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in homes[0])
    assert all(a is b for later in homes[1:] for a, b in zip(homes[0], later))  # the same host tensors every step
    return allocated[-1]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_offloaded_gradients_reach_persistent_host_tensors_without_new_host_memory_per_piece(tier, tmp_path):
    """16-bit gradients are copied into fp32 host tensors made once (page-locked on CUDA), not into a new tensor
    per piece per step: host allocations per step do not grow with the number of pieces."""
    assert _host_bytes_per_step(tier, 2, tmp_path) == _host_bytes_per_step(tier, 4, tmp_path)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_offloaded_copies_start_when_each_bucket_is_reduced_and_change_no_bit(zero_stage):
    """ZeRO 0-1 reduce each bucket once, in the last micro-batch's backward: its host copy is issued then, before
    the later buckets' reductions are launched (not after backward, in finish), and the host normalises the
    copied values exactly as the device does, so the weights equal the run that steps on the device, bit for bit."""
    on_device, _, _ = train_recording("none", zero_stage)
    offloaded, events, home_of_bucket = train_recording("cpu", zero_stage)
    assert all(torch.equal(a, b) for a, b in zip(on_device, offloaded))
    assert copied_before_last_launch(events, home_of_bucket)


def test_zero2_buckets_are_copied_when_final():
    """ZeRO-2 adds each micro-batch's reduction into the owned slice in finish(): its buckets are not final when
    reduced, so their copies start only in finish(), after every launch, with the same weights as on the device."""
    on_device, _, _ = train_recording("none", 2)
    offloaded, events, _ = train_recording("cpu", 2)
    assert all(torch.equal(a, b) for a, b in zip(on_device, offloaded))
    last_launch = max(i for i, (kind, _) in enumerate(events) if kind == "launch")
    assert not any(kind == "copy" for kind, _ in events[:last_launch])


@pytest.mark.slow
def test_offloaded_copies_wait_for_each_buckets_collective_over_two_ranks(tmp_path):
    """dp=2 over gloo: each early copy waits for its bucket's all-reduce (ZeRO 0) or reduce-scatter (ZeRO-1), and the
    collective's work is waited for again in finish(); the offloaded weights equal the device-stepped ones."""
    results, _ = run_job("offload_overlap", 2, tmp_path)
    expected = {"z0": {"equal": True, "copied_early": True}, "z1": {"equal": True, "copied_early": True}}
    assert results == [expected, expected]


def _run_offload_process(root, then: str, **popen):
    """A Python process that makes an 'nvme' folder under ``root`` (as a rank's tier does), then runs ``then``."""
    code = ("import os, signal, sys, torch\n"
            "from lightning_megatron.offload.files import OffloadFiles\n"
            f"files = OffloadFiles({str(root)!r}, {{'main': (1 << 18, torch.float32)}},\n"
            "                     prefix='lightning-megatron-rank0-')\n"
            "print(files.folder, flush=True)\n" + then)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **popen)


@pytest.mark.slow
def test_the_next_tier_removes_the_files_of_a_killed_rank_and_leaves_a_live_runs(tmp_path, capfd):
    # Both processes start at once (each spends seconds importing torch).
    killed = _run_offload_process(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n")
    alive = _run_offload_process(tmp_path, "sys.stdin.read()\n", stdin=subprocess.PIPE)
    killed_folder = killed.stdout.readline().strip()
    assert killed.wait(timeout=120) == -signal.SIGKILL
    alive_folder = alive.stdout.readline().strip()
    foreign = tmp_path / "lightning-megatron-rank1-elsewhere"  # a run on another host sharing this folder
    foreign.mkdir()
    (foreign / "owner.json").write_text(json.dumps({"pid": 1, "start_time": 0, "host": "another-host"}))
    (foreign / "main.bin").write_bytes(b"\0" * 2**20)
    try:
        assert os.path.getsize(os.path.join(killed_folder, "main.bin")) == 2**20  # its optimizer share, left behind
        capfd.readouterr()
        model = nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters())
        sync = GradientSynchronizer(list(model.parameters()), data_parallel_group=None, bucket_size_mb=0.001,
                                    zero_stage=0)
        main = MainParamOptimizer(optimizer, sync, offload=OffloadSettings("nvme", path=str(tmp_path)))
        err = capfd.readouterr().err
        assert not os.path.exists(killed_folder), "the killed run's files are still there"
        removed = f"removed {killed_folder} (1.00 MiB): 'nvme' offload files of a run that is gone (pid {killed.pid}"
        assert removed in err
        assert os.path.isdir(alive_folder) and alive_folder not in err, "a live run's files were touched or named"
        assert f"{foreign} holds 1.00 MiB of 'nvme' offload files of pid 1 on host another-host" in err
        assert f"rm -r {foreign}" in err and foreign.is_dir()
        own = main.nvme.files.folder
        main.remove()
        assert not own.exists()
    finally:
        alive.stdin.close()
        alive.wait(timeout=120)
    assert not os.path.exists(alive_folder), "a normal exit that never closed the tier left its files"


@pytest.mark.slow
def test_an_uncaught_error_leaves_no_offload_files(tmp_path):
    failed = _run_offload_process(tmp_path, "raise ValueError('bad data')\n", stderr=subprocess.PIPE)
    folder = failed.stdout.readline().strip()
    _, err = failed.communicate(timeout=120)
    assert failed.returncode == 1 and "ValueError: bad data" in err
    assert folder and not os.path.exists(folder) and list(tmp_path.iterdir()) == []


def test_an_owner_elsewhere_is_never_taken_for_gone():
    """Only a process of this host, boot and pid namespace can be checked; elsewhere its pid means nothing here."""
    from lightning_megatron.offload.files import machine_identity, owner_state, process_start_time

    me = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), **machine_identity()}
    assert owner_state(me) == "alive"
    assert owner_state({**me, "start_time": me["start_time"] + 1}) == "gone", "a reused pid is another process"
    for elsewhere in ({"host": "another-host"}, {"pid_namespace": "pid:[1]"}, {"boot_id": "another-boot"}):
        assert owner_state({**me, **elsewhere, "pid": 2**22 + 1}) == "unknown", elsewhere
