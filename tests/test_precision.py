"""Mixed precision inside the Trainer: every flavour stays near fp32; an fp16 overflow on one rank
skips that step on every rank and training recovers."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from launch import run_job
from lightning_megatron.optim.loss_scaler import DynamicLossScaler, agree_on_overflow, found_overflow
from lightning_megatron.parallel.guards import check_collective_devices, count_host_syncs
OVERFLOW_STEP = 2  # as in workers/precision_fit.py

# fp16-true-zero3 runs at tp=1 x dp=2 (FSDP2 casting fp32 shards to fp16), the others at tp=2.
TOLERANCE = {"bf16-true": 3e-2, "bf16-mixed": 3e-2, "fp16-true": 5e-3, "fp16-mixed": 5e-3, "fp16-true-zero3": 5e-3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results, _ = run_job("precision_fit", 2, tmp_path_factory.mktemp("precision"), timeout=900)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("precision", sorted(TOLERANCE))
def test_low_precision_stays_within_its_tolerance_of_fp32(runs, precision):
    for result in runs:
        reference, losses = result["fp32"]["losses"], result[precision]["losses"]
        assert len(losses) == len(reference) == 5
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        assert worst < TOLERANCE[precision], (precision, losses, reference)
        assert losses != reference, "the run must really have been in low precision"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_within_bf16s_tolerance_of_fp32(runs, recipe):
    """FP8 GEMMs on top of bf16-mixed at tp2, through the Trainer: near fp32, and not the bf16 run itself."""
    for result in runs:
        reference, losses = result["fp32"]["losses"], result[f"bf16-mixed-fp8-{recipe}"]["losses"]
        assert len(losses) == 5
        assert max(abs(a - b) for a, b in zip(losses, reference)) < TOLERANCE["bf16-mixed"], (losses, reference)
        assert losses != result["bf16-mixed"]["losses"], "the fp8 GEMMs must really have run"


@pytest.mark.slow
def test_a_bf16_run_resumes_in_fp8_and_back_and_no_checkpoint_holds_fp8(runs):
    """Checkpoints hold the same (fp32) tensors with and without fp8: a bf16 checkpoint resumes in fp8 (steps 3-4) and
    the fp8 run's checkpoint resumes in bf16 (step 5), each step near the straight bf16 run's."""
    for result in runs:
        chain, straight = result["fp8-chain"], result["bf16-mixed"]["losses"]
        bf16_saved, fp8_saved = chain["saved_dtypes"]
        assert bf16_saved == fp8_saved and "torch.float32" in bf16_saved, chain
        assert not any("float8" in dtype for dtype in fp8_saved), chain
        assert len(chain["losses"]) == len(straight) == 5
        assert chain["losses"][:2] == straight[:2], "the first two steps are the same bf16 run"
        assert max(abs(a - b) for a, b in zip(chain["losses"], straight)) < TOLERANCE["bf16-mixed"], (chain, straight)
        assert chain["losses"][2:4] != straight[2:4], "steps 3-4 ran in fp8"


@pytest.mark.slow
@pytest.mark.parametrize("run_name", ["fp16-overflow", "fp16-overflow-zero3"])
def test_fp16_overflow_on_one_rank_skips_that_step_on_every_rank_and_recovers(runs, run_name):
    for result in runs:
        run = result[run_name]
        assert run["skipped"] == 1
        assert run["loss_scale"] == 2.0**12 / 2, "hysteresis 1: one overflow halves the scale"
        checksums = run["checksums"]
        assert checksums[OVERFLOW_STEP] == checksums[OVERFLOW_STEP - 1], "the overflowing step changed weights"
        assert all(a != b for i, (a, b) in enumerate(zip(checksums, checksums[1:])) if i + 1 != OVERFLOW_STEP)
        assert all(loss == loss for i, loss in enumerate(run["losses"]) if i != OVERFLOW_STEP), "training recovers"
    if run_name == "fp16-overflow":  # tp=2 x dp=1: both ranks hold half of every matrix
        assert runs[0][run_name]["checksums"] == pytest.approx(runs[1][run_name]["checksums"], rel=0.2)


def test_loss_scaler_growth_backoff_and_hysteresis():
    scaler = DynamicLossScaler(initial_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0)
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert scaler.scale == 16.0
    scaler.update(overflow=True)
    assert scaler.scale == 16.0, "the first overflow is absorbed by hysteresis"
    scaler.update(overflow=True)
    assert scaler.scale == 8.0
    for _ in range(5):
        scaler.update(overflow=True)
    assert scaler.scale == 2.0 and scaler.skipped_steps == 7
    restored = DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match="growth_factor > 1"):
        DynamicLossScaler(growth_factor=1.0)


@pytest.mark.slow
def test_offloaded_optimizer_steps_in_cpu_memory_with_identical_results(runs):
    for result in runs:
        offloaded, reference = result["bf16-true-offload"], result["bf16-true"]
        assert offloaded["losses"] == reference["losses"] and offloaded["checksums"] == reference["checksums"]
        assert offloaded["optimizer_devices"] == ["cpu"]


@pytest.mark.slow
def test_nvme_tier_steps_16_bit_runs_exactly_as_the_device_and_skips_fp16_overflows(runs):
    """16-bit gradients reach the 'nvme' tier through its file-backed fp32 copies; an fp16 overflow on one rank skips
    the step on every rank without touching the files."""
    for result in runs:
        for offloaded, reference in (("bf16-true-nvme", "bf16-true"), ("fp16-overflow-nvme", "fp16-overflow")):
            assert result[offloaded]["losses"] == result[reference]["losses"], offloaded
            assert result[offloaded]["checksums"] == result[reference]["checksums"], offloaded
            assert result[offloaded]["skipped"] == result[reference]["skipped"], offloaded
            assert result[offloaded]["optimizer_devices"] == ["cpu"]


def _pieces(count: int, *, poisoned: bool) -> list[torch.Tensor]:
    """``count`` gradient pieces of mixed dtypes (fp32 offloaded, 16-bit on the device), the last one Inf if asked."""
    pieces = [torch.randn(5 + i, dtype=(torch.float32, torch.bfloat16, torch.float16)[i % 3]) for i in range(count)]
    if poisoned:
        pieces[-1][2] = float("inf")
    return pieces


@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "overflow"])
def test_the_fp16_overflow_check_reads_the_host_once_however_many_pieces(poisoned):
    """One host read per step: on CUDA each read stalls the queue, and a model has hundreds of pieces."""
    verdicts, reads = [], []
    for count in (6, 12):
        grads = _pieces(count, poisoned=poisoned)
        before = [g.clone() for g in grads]
        with count_host_syncs() as syncs:
            verdicts.append(found_overflow(grads + [None], torch.device("cpu")))
        reads.append(syncs.total)
        assert all(torch.equal(a, b) for a, b in zip(before, grads))  # the check changes no gradient
    assert verdicts == [poisoned, poisoned] and reads == [1, 1]


def test_grad_scalers_found_inf_is_reduced_on_the_strategys_device_not_where_the_gradients_are(one_rank_group):
    """``16-mixed`` + ``offload_optimizer``: GradScaler's flag is where the offloaded gradients are (the host), while
    NCCL takes tensors on the accelerator only. Fake tensors stand for a CUDA strategy on this machine: the one
    all-reduce must be handed a tensor on ``cuda``, and GradScaler's flag must stay where it reads it."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
        for param in params:
            param.grad = torch.zeros(4)
        optimizer = torch.optim.SGD(params, lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.ones(()))  # as the loss is scaled before backward
        agree_on_overflow(scaler, torch.device("cuda", 0))
        with check_collective_devices(torch.device("cuda", 0)) as checked:
            scaler.unscale_(optimizer)
        flags = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    assert sum(checked.values()) == 1  # one all-reduce, on the strategy's device
    assert [flag.device.type for flag in flags.values()] == ["cpu"]
