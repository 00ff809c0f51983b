"""ZeRO memory: exact per-rank bytes against the ZeRO paper's formulas, and the errors a user gets."""

import pytest
import torch

from launch import run_job
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.optim import GradientSynchronizer
from lightning_megatron.optim.main_params import MainParamOptimizer


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    results, _ = run_job("zero_bytes", 4, tmp_path_factory.mktemp("zero"))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp1-dp4", "tp2-dp2"])
def test_model_state_bytes_follow_the_zero_formulas(measured, layout):
    """Mixed-precision Adam, Psi local params, N = dp: 16Psi, 4Psi + 12Psi/N, 2Psi + 14Psi/N."""
    for rank, result in enumerate(measured):
        by_stage = {z: result[f"{layout}-z{z}"] for z in (0, 1, 2)}
        psi, n = by_stage[0]["psi"], by_stage[0]["dp"]
        formulas = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n}
        for stage, entry in by_stage.items():
            total = sum(entry["bytes"].values())
            # Each bucket is padded to a multiple of N elements: at most N-1 extra per bucket, 2 bytes
            # (gradient shard) and 12 bytes (main param + 2 Adam moments) each.
            bound = entry["buckets"] * (n - 1) * 14
            assert abs(total - formulas[stage]) <= bound, (rank, layout, stage, entry, formulas[stage])
        assert by_stage[0]["bytes"]["parameters"] == 2 * psi
        assert by_stage[2]["bytes"]["gradients"] < by_stage[1]["bytes"]["gradients"] == 2 * psi


@pytest.mark.slow
def test_tensor_parallelism_divides_the_model_state(measured):
    tp1, tp2 = measured[0]["tp1-dp4-z0"]["psi"], measured[0]["tp2-dp2-z0"]["psi"]
    assert tp2 < 0.6 * tp1  # half of everything but the replicated norms, biases and positions


def test_non_elementwise_optimizer_is_refused():
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    sync = GradientSynchronizer([param], data_parallel_group=None, zero_stage=1)
    with pytest.raises(ValueError, match=r"only correct for element-wise optimizers .* got LBFGS"):
        MainParamOptimizer(torch.optim.LBFGS([param]), sync)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(zero_stage=4), "zero_stage must be 0"),
        (dict(zero_stage=0, overlap_param_gather=True), r"overlap_param_gather=True .* zero_stage=0 has no such"),
        (dict(zero_stage=3, overlap_param_gather=True), r"overlap_param_gather=True .* zero_stage=3 has no such"),
    ],
)
def test_bad_zero_stage(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Megatron3DStrategy(**kwargs)


def test_fp32_parameters_need_no_main_copy_under_zero():
    """At 32-true the owned pieces are views of the parameters' flat buffer: no extra 4Psi/N bytes."""
    param = torch.nn.Parameter(torch.randn(1000))
    sync = GradientSynchronizer([param], data_parallel_group=None, zero_stage=1)
    main = MainParamOptimizer(torch.optim.AdamW([param], lr=0.1), sync)
    assert main.main_param_bytes() == 0
    param.sum().backward()
    sync.finish(torch.tensor(1.0))
    main.prepare_step()
    before = param.detach().clone()
    main.optimizer.step()
    main.finish_step()
    assert not torch.equal(param.detach(), before), "the step must update the parameter through the view"
