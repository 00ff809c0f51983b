"""Lightning features under Megatron3DStrategy: metric precision, a second fit, SWA, detect_anomaly, the
model summary and the model-state line. One 4-rank launch (tests/workers/interop.py) runs every scenario."""

import re

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary, get_human_readable_count
from torch import nn
from torchmetrics import MeanMetric, SumMetric

from launch import launch
from workers.trainer_setup import model
from lightning_megatron.strategy.lightning_features import prepare_metrics
from lightning_megatron.optim.main_params import MODEL_STATE_KEYS
from lightning_megatron.strategy.summary import GlobalModelSummary, format_model_state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("interop")
    results, proc = launch("interop.py", 4, out)  # fresh: it checks that no process group was made
    assert len(results) == 4
    return results, proc.stdout + proc.stderr


@pytest.mark.slow
def test_swa_under_pipelining_is_refused_on_every_rank_before_any_collective(runs):
    results, _ = runs
    for result in results:
        swa = result["swa"]
        assert swa["error"] and "StochasticWeightAveraging" in swa["error"], swa
        assert "tensor_parallel_size=2, pipeline_parallel_size=2" in swa["error"]
        assert "consolidated_state_dict" in swa["error"]  # the fix
        assert not swa["distributed_initialized"]


@pytest.mark.slow
def test_detect_anomaly_under_pipelining_is_refused_on_every_rank_before_any_collective(runs):
    results, _ = runs
    for result in results:
        anomaly = result["anomaly"]
        assert anomaly["error"] and "detect_anomaly=True" in anomaly["error"], anomaly
        assert "pipeline_parallel_size=2" in anomaly["error"] and "detect_anomaly=False" in anomaly["error"]
        assert not anomaly["distributed_initialized"]


@pytest.mark.slow
def test_bf16_true_validation_metric_accumulates_in_fp32(runs):
    results, _ = runs
    runs_of_replicas = [r["bf16"] for r in results if r["bf16"]["tp_rank"] == 0]
    assert sorted(r["dp_rank"] for r in runs_of_replicas) == [0, 1]
    fed = [pair for r in runs_of_replicas for pair in r["fed"]]
    assert len(fed) == 4  # 2 validation batches on each dp rank
    reference = sum(loss * tokens for loss, tokens in fed) / sum(tokens for _, tokens in fed)
    for result in results:
        bf16 = result["bf16"]
        assert bf16["state_dtype"] == bf16["metric_dtype"] == "torch.float32"
        assert abs(bf16["val_loss"] - reference) < 2e-6 * reference, (bf16["val_loss"], reference)
        assert abs(bf16["val_perplexity"] - torch.tensor(reference).exp().item()) < 1e-5 * bf16["val_perplexity"]


@pytest.mark.slow
def test_second_fit_of_a_pipeline_split_module_continues_as_one_fit(runs):
    results, _ = runs
    for result in results:
        one_fit, refit = result["one_fit"]["losses"], result["refit"]["losses"]
        assert len(refit) == len(one_fit) == 4
        assert torch.allclose(torch.tensor(refit), torch.tensor(one_fit), rtol=0, atol=1e-6), (refit, one_fit)


SUMMARISED = ["bf16", "pp2", "one_fit"]  # tp2 x dp2, pp2 x dp2, tp2 x pp2, in the order they ran


@pytest.mark.slow
@pytest.mark.parametrize("run", SUMMARISED)
def test_model_summary_counts_the_global_model(runs, run):
    results, output = runs
    gpt = model(results[0][run]["options"])
    gpt.configure_model()
    expected, unsplit = gpt.config.num_parameters(), ModelSummary(gpt, max_depth=-1)
    for result in results:
        summary = result[run]["summary"]
        assert summary["total"] == summary["trainable"] == expected, (summary, expected)
        assert summary["rows"] == {"model": expected, "val_loss": 0}
        # Every module, as Lightning summarises the unsplit model (names and parameter counts in its order).
        assert [tuple(row) for row in summary["every_module"]] == list(zip(unsplit.layer_names, unsplit.param_nums))
    # What rank 0 printed (RichModelSummary: "Total params: 60.1 K"; ModelSummary: "60.1 K    Total params").
    printed = re.findall(r"^Total params: (\S+(?: \S)?)\s*$|^\s*(\S+(?: \S)?)\s+Total params\s*$", output,
                         flags=re.MULTILINE)
    printed = [rich or plain for rich, plain in printed]
    assert len(printed) == len(SUMMARISED), printed
    assert printed[SUMMARISED.index(run)] == get_human_readable_count(expected)


@pytest.mark.slow
def test_model_state_is_one_line_with_every_ranks_extremes(runs):
    results, output = runs
    lines = [line for line in output.splitlines() if "model state" in line]
    fits = len(results[0]["model_state_bytes"])
    assert fits == 4 and len(lines) == fits, lines  # one line per fit, not one per rank
    for fit, line in enumerate(lines):
        per_rank = [result["model_state_bytes"][fit] for result in results]
        assert all(set(sizes) == set(MODEL_STATE_KEYS) for sizes in per_rank)
        totals = [sum(sizes.values()) for sizes in per_rank]
        lows = [min(sizes[key] for sizes in per_rank) for key in MODEL_STATE_KEYS] + [min(totals)]
        highs = [max(sizes[key] for sizes in per_rank) for key in MODEL_STATE_KEYS] + [max(totals)]
        assert line.endswith(format_model_state(lows, highs, world=4)), (line, lows, highs)
    # Pipeline stages hold different layers: their extremes differ and are both shown.
    assert " / " in lines[1]


def test_metric_states_widen_to_fp32_and_integer_states_stay():
    class WithMetrics(nn.Module):
        def __init__(self):
            super().__init__()
            self.mean, self.total = MeanMetric(), SumMetric()
            self.count = MeanMetric()
            self.count.add_state("seen", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    module = HalfPrecision("bf16-true").convert_module(WithMetrics()).to("cpu")  # as the strategy's set-up
    assert module.mean.mean_value.dtype == torch.bfloat16  # what the precision plugin does to metric states
    assert module.mean.dtype == torch.float32  # ... while .to(device) says fp32
    prepare_metrics(module, None)
    module.mean.update(torch.tensor(1 / 3), weight=3)
    assert module.mean.mean_value.dtype == module.total.sum_value.dtype == module.mean.dtype == torch.float32
    assert module.mean.compute().item() == torch.tensor(1 / 3).item()
    assert module.count.seen.dtype == torch.int64


@pytest.mark.parametrize("depth", [1, 2, -1])
def test_global_summary_of_an_unsplit_model_is_lightnings(depth):
    gpt = model({"layers": 2})
    gpt.configure_model()
    ours, lightnings = GlobalModelSummary(gpt, max_depth=depth), ModelSummary(gpt, max_depth=depth)
    assert ours._get_summary_data() == lightnings._get_summary_data()
    assert (ours.total_parameters, ours.trainable_parameters, ours.total_training_modes) == (
        lightnings.total_parameters, lightnings.trainable_parameters, lightnings.total_training_modes)
    assert ours.total_parameters == gpt.config.num_parameters()
