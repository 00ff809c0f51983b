"""Megatron3DStrategy inside Lightning's Trainer, against a plain single-process Lightning run."""

import json

import lightning as L
import pytest
import torch

from launch import launch, run_job
from lightning_megatron.pipeline.timeline import theoretical_bubble
from workers.trainer_setup import PREDICT_GENERATION, PREDICT_PROMPTS, datamodule, model, trainer_kwargs
import lightning_megatron  # noqa: F401  (registers "megatron_3d")
from lightning_megatron.cli import main as cli_main
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.checkpoint import consolidated_state_dict, open_sharded

FIT = {"tp": 2, "sp": True, "accumulate": 2, "clip": 0.5, "steps": 5, "zero_stage": 1, "checksums": True}
PIPELINE_FIT = {"tp": 2, "pp": 2, "sp": True, "accumulate": 2, "clip": 0.5, "steps": 4, "micro_batch_size": 2,
                "layers": 4, "timeline": True, "recompute": "selective", "zero_stage": 2, "test": True,
                "predict": True}


def plain_lightning_run(options):
    """Lightning's default single-device strategy: no tensor parallelism, no dp, our model unchanged."""
    L.seed_everything(options.get("seed", 7))
    losses, plain_lightning_run.val_losses = [], []

    class RecordLosses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            if trainer.global_step == options.get("save_at_step"):  # the weights the worker's checkpoint holds
                plain_lightning_run.weights_at_step = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

        def on_validation_end(self, trainer, pl_module):  # after the module logged its epoch's loss
            plain_lightning_run.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[RecordLosses()], **trainer_kwargs(options))
    gpt = model(options)
    trainer.fit(gpt, datamodule=datamodule(options))
    val_loss = float(trainer.callback_metrics["val_loss"])
    if options.get("test"):
        plain_lightning_run.test_loss = trainer.test(gpt, datamodule=datamodule(options), verbose=False)[0]["test_loss"]
    return losses, val_loss, {k: v.detach() for k, v in gpt.state_dict().items()}


@pytest.fixture(scope="module")
def fit_tp2_dp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("fit")
    results, _ = run_job("trainer_fit", 4, out, json.dumps(FIT))
    return out, results


@pytest.mark.slow
def test_fit_tp2_dp2_sequence_parallel_zero1_matches_plain_lightning(fit_tp2_dp2):
    out, results = fit_tp2_dp2
    ref_losses, ref_val, ref_weights = plain_lightning_run(FIT)
    assert len(results) == 4
    assert all(result["sampler_replicas"] == 2 for result in results), "the sampler must split over dp only"
    # Ranks are (dp, tp) = (0,0), (0,1), (1,0), (1,1). Lightning reports micro-batch losses; the two dp
    # ranks' micro-batches hold exactly the samples of the reference micro-batch (equal token counts).
    per_rank = torch.tensor([r["losses"] for r in results])
    assert per_rank.shape[1] == len(ref_losses) == FIT["steps"] * FIT["accumulate"]
    assert torch.equal(per_rank[0], per_rank[1]), "the two tp ranks of a replica must see the same loss"
    dp_mean = (per_rank[0] + per_rank[2]) / 2
    assert torch.allclose(dp_mean, torch.tensor(ref_losses), atol=1e-5), (dp_mean, ref_losses)
    assert abs(results[0]["val_loss"] - ref_val) < 1e-5

    weights = torch.load(out / "weights.pt", weights_only=True)
    assert weights.keys() == ref_weights.keys()
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert worst < 1e-5, f"weights deviate by {worst:.2e}"


# adam_eps: the untied embedding's rarely seen rows have near-zero gradients (see workers/gpt_setup.py: optimizer).
LLAMA_FIT = {**FIT, "preset": "llama-tiny", "groups": 1, "checksums": False, "adam_eps": 1e-3, "tp_comm_overlap": True}


@pytest.mark.slow
def test_fit_llama_with_replicated_key_value_heads_matches_plain_lightning(tmp_path):
    """The Llama-shaped model (RMSNorm, rotary, SwiGLU) with one key/value head on tp=2: each tp rank holds half the
    query heads and a replica of the key/value head, whose gradient the strategy sums over the two replicas; with
    sequence parallelism (its collectives overlapped with the GEMMs: tp_comm_overlap), dp=2, ZeRO-1 and
    accumulation, through Lightning's loop."""
    results, _ = run_job("trainer_fit", 4, tmp_path, json.dumps(LLAMA_FIT))
    assert all(r["sequence_linears"] == ["OverlappedSequenceParallelLinear"] for r in results)
    ref_losses, ref_val, ref_weights = plain_lightning_run(LLAMA_FIT)
    per_rank = torch.tensor([r["losses"] for r in results])
    assert torch.equal(per_rank[0], per_rank[1])
    assert torch.allclose((per_rank[0] + per_rank[2]) / 2, torch.tensor(ref_losses), atol=1e-5)
    assert abs(results[0]["val_loss"] - ref_val) < 1e-5
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert weights.keys() == ref_weights.keys()
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert worst < 1e-5, f"weights deviate by {worst:.2e}"


def assert_predictions_match(options, ref_weights, results, out_dir, *, dp_rank):
    """trainer.predict on the split model (the worker's predict option): every rank returns what the one-process
    model generates from, and the full unpadded logits of, the same batch; Lightning gives data-parallel rank d the
    items d, d + 2, ... (dp=2)."""
    reference = model(options)
    reference.configure_model()
    reference.load_state_dict(ref_weights)
    # Greedy from a callback at the (last) validation inside fit: the final weights, the same on every rank.
    during_fit = reference.generate(PREDICT_PROMPTS[:2], max_new_tokens=5)
    assert all(result["predicted"]["during_fit"] == during_fit for result in results), during_fit
    for rank, result in enumerate(results):
        d = dp_rank(rank)
        expected = reference.generate(PREDICT_PROMPTS[d::2], **PREDICT_GENERATION)
        assert result["predicted"]["tokens"] == [expected], (rank, result["predicted"], expected)
        ids = torch.stack([torch.arange(i, i + 12) % 257 for i in range(0, 40, 10)][d::2])
        (logits,) = torch.load(out_dir / f"logits{rank}.pt", weights_only=True)["logits"]
        with torch.no_grad():
            want = reference(ids)
        assert logits.shape == want.shape == (2, 12, 257)
        assert (logits - want).abs().max() < 1e-5


@pytest.mark.slow
def test_fit_pp2_tp2_dp2_matches_plain_lightning(tmp_path):
    """8 ranks: the pipeline schedule inside Lightning's loop, with tp, sequence parallel, dp, ZeRO-2,
    selective recomputation and accumulation."""
    results, _ = run_job("trainer_fit", 8, tmp_path, json.dumps(PIPELINE_FIT))
    ref_losses, ref_val, ref_weights = plain_lightning_run(PIPELINE_FIT)
    per_rank = torch.tensor([r["losses"] for r in results])
    # rank = (pp * dp_size + dp) * tp_size + tp: every rank of a replica reports the replica's loss.
    replica0, replica1 = per_rank[[0, 1, 4, 5]], per_rank[[2, 3, 6, 7]]
    assert (replica0 == replica0[0]).all() and (replica1 == replica1[0]).all()
    assert torch.allclose((replica0[0] + replica1[0]) / 2, torch.tensor(ref_losses), atol=1e-5)
    assert all(abs(r["val_loss"] - ref_val) < 1e-5 for r in results), "every rank logs the last stage's val loss"
    assert all(abs(r["test_loss"] - plain_lightning_run.test_loss) < 1e-5 for r in results), "test: forward-only schedule"
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert weights.keys() == ref_weights.keys()
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert worst < 1e-5, f"weights deviate by {worst:.2e}"
    bubble = results[0]["bubble"]
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert 0.0 < bubble["measured"] < 1.0 and bubble["theory"] == pytest.approx(1 / 3)  # p=2, m=2: (1/2)/(1+1/2)

    assert_predictions_match(PIPELINE_FIT, ref_weights, results, tmp_path, dp_rank=lambda rank: (rank // 2) % 2)


# ZB-V: a split backward (weight passes in the bubbles) and the V placement (embedding and head on rank 0).
ZERO_BUBBLE_FIT = {"tp": 1, "pp": 2, "vpp": 2, "schedule": "zbv", "clip": 0.5, "steps": 4, "micro_batch_size": 1,
                   "layers": 4, "timeline": True, "recompute": "full", "zero_stage": 1, "test": True, "predict": True}


@pytest.mark.slow
def test_fit_zero_bubble_pp2_dp2_matches_plain_lightning(tmp_path):
    """4 ranks, pp2 x dp2 under ZB-V with full recomputation and ZeRO-1: training, validation and test (forward-only
    schedule), the timeline of a split backward against the schedule's own theory, then generation and predict
    through the V placement (stages 0 and 3 on pipeline rank 0, 1 and 2 on rank 1)."""
    results, _ = run_job("trainer_fit", 4, tmp_path, json.dumps(ZERO_BUBBLE_FIT))
    ref_losses, ref_val, ref_weights = plain_lightning_run(ZERO_BUBBLE_FIT)
    per_rank = torch.tensor([r["losses"] for r in results])
    assert torch.allclose((per_rank[0] + per_rank[1]) / 2, torch.tensor(ref_losses), atol=1e-5)  # dp ranks 0, 1
    assert all(abs(r["val_loss"] - ref_val) < 1e-5 for r in results)
    assert all(abs(r["test_loss"] - plain_lightning_run.test_loss) < 1e-5 for r in results)
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert worst < 1e-5, f"weights deviate by {worst:.2e}"
    bubble = results[0]["bubble"]
    assert 0.0 < bubble["measured"] < 1.0 and 0.0 < bubble["theory"] < theoretical_bubble(2, 4, 2)
    assert_predictions_match(ZERO_BUBBLE_FIT, ref_weights, results, tmp_path, dp_rank=lambda rank: rank % 2)


def _worst(weights, reference):
    assert weights.keys() == reference.keys()
    return max((weights[k] - reference[k]).abs().max().item() for k in reference)


@pytest.mark.slow
def test_dp2_with_uneven_token_counts_and_overlapped_param_gather_matches_plain_lightning(tmp_path):
    """Each dp rank counts different tokens (ignored labels): the loss is still the per-token mean of the
    global batch, as one process computes it (accumulation 1, so plain Lightning's mean is the same).

    With ZeRO-2's parameter all-gathers overlapped with the next forward (``overlap_param_gather``), while rank 1
    reaches every step late (rank 0's gathers are in flight when it goes on): a checkpoint saved right after step 2
    holds the updated weights, the validation after step 3 and every forward see them, and the run ends with the
    weights of plain Lightning, which never overlaps anything. (A full checkpoint: rank 0 reads its weights before
    any collective of the save, so only the wait keeps it from reading them stale; a sharded save synchronises
    with the late rank before it reads, on gloo.) The layers are compiled (regional compilation through the
    strategy's wiring; aot_eager: tracing without code generation, cheap on 2 cores): the uncompiled single-process
    run is still the reference."""
    options = {"tp": 1, "steps": 4, "uneven_tokens": True, "zero_stage": 2, "overlap": True, "late_rank": 1,
               "save_at_step": 2, "val_every": 3, "checkpoint_format": "full", "compile": {"backend": "aot_eager"}}
    results, _ = run_job("trainer_fit", 2, tmp_path, json.dumps(options))
    ref_losses, ref_val, ref_weights = plain_lightning_run(options)
    assert _worst(torch.load(tmp_path / "weights.pt", weights_only=True), ref_weights) < 1e-5
    saved = torch.load(tmp_path / "step2.ckpt", weights_only=False)["state_dict"]
    assert _worst(saved, plain_lightning_run.weights_at_step) < 1e-5
    assert len(plain_lightning_run.val_losses) == 1
    for result in results:
        assert result["val_losses"] == pytest.approx(plain_lightning_run.val_losses, abs=1e-5)
        assert len(result["losses"]) == len(ref_losses) == 4
    assert results[0]["losses"] != results[1]["losses"], "the ranks must have seen different batches"


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{"tp": 2, "sp": True, "accumulate": 2, "clip": 0.5, "steps": 4, "zero_stage": 3, "predict": True},
     {"tp": 1, "pp": 2, "micro_batch_size": 2, "layers": 4, "clip": 0.5, "steps": 4, "zero_stage": 3, "predict": True}],
    ids=["tp2-sp-dp2", "pp2-dp2"],
)
def test_fit_zero3_matches_plain_lightning(options, tmp_path):
    """Parameters sharded over dp (FSDP2 per layer) with tensor or pipeline parallelism, clipping, accumulation;
    then trainer.predict (generation and full logits) on the sharded model."""
    results, _ = run_job("trainer_fit", 4, tmp_path, json.dumps(options))
    ref_losses, ref_val, ref_weights = plain_lightning_run(options)
    per_rank = torch.tensor([r["losses"] for r in results])
    # Ranks of dp 0 and dp 1: (0, 2) for tp=2; (0, 1) for pp=2 with tp=1.
    other = 2 if options["tp"] == 2 else 1
    assert torch.allclose((per_rank[0] + per_rank[other]) / 2, torch.tensor(ref_losses), atol=1e-5)
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert weights.keys() == ref_weights.keys()
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert worst < 1e-5, f"weights deviate by {worst:.2e}"
    # rank = (pp * dp + dp_rank) * tp + tp_rank
    tp = options["tp"]
    assert_predictions_match(options, ref_weights, results, tmp_path, dp_rank=lambda rank: (rank // tp) % 2)


@pytest.mark.slow
def test_checkpoint_is_layout_free_and_loads_without_unpickling(fit_tp2_dp2):
    out, _ = fit_tp2_dp2
    saved = open_sharded(out / "last.ckpt")  # checks the files; never unpickles (DCP index aside)
    weights = torch.load(out / "weights.pt", weights_only=True)
    assert saved.info["layout"]["tensor_parallel_size"] == 2
    gpt = model(FIT)
    gpt.configure_model()
    gpt.load_state_dict(consolidated_state_dict(out / "last.ckpt"))  # a plain single-process model takes it as is
    for name, value in gpt.state_dict().items():
        assert torch.equal(value, weights[name]), name


@pytest.mark.slow
def test_every_rank_checksums_the_files_it_wrote(fit_tp2_dp2, capsys):
    """The table in megatron_3d.json names every file of the 4-rank checkpoint, and each one matches."""
    out, _ = fit_tp2_dp2
    saved = open_sharded(out / "last.ckpt")
    recorded = set(saved.info["checksums"]["files"])
    assert recorded == {file.name for file in saved.path.iterdir() if file.name != "megatron_3d.json"}
    assert {f"__{rank}_0.distcp" for rank in range(4)} <= recorded
    cli_main(["checkpoint", "verify", str(saved.path)])
    assert "every crc32 matches" in capsys.readouterr().out


@pytest.fixture(scope="module")
def not_divisible(tmp_path_factory):
    """One fresh launch (the process must not have joined a process group: a pool's ranks have), two fits one after
    another: heads no tp2 divides, then query groups tp2 can neither split nor replicate (each fit records whether
    the process had joined a group when it failed, so the second also shows the first left none)."""
    out = tmp_path_factory.mktemp("not_divisible")
    launch("trainer_fit.py", 2, out, json.dumps({"tp": 2, "hidden": 48, "heads": 3}),
           json.dumps({"tp": 2, "hidden": 48, "heads": 6, "groups": 3, "preset": "llama-tiny"}))
    return [[json.loads((out / f"fit{fit}" / f"rank{rank}.json").read_text()) for rank in range(2)] for fit in range(2)]


@pytest.mark.slow
def test_heads_not_divisible_fails_on_every_rank_before_any_collective(not_divisible):
    results = not_divisible[0]
    assert len(results) == 2
    for result in results:
        assert "tensor_parallel_size=2 does not divide num_heads=3" in result["error"]
        assert "Use a tensor_parallel_size in [1, 3]" in result["error"]
        assert result["distributed_initialized"] is False


@pytest.mark.slow
def test_query_groups_tp_can_neither_split_nor_replicate_fails_on_every_rank_before_any_collective(not_divisible):
    results = not_divisible[1]
    assert len(results) == 2
    for result in results:
        assert "tensor_parallel_size=2 can neither split num_query_groups=3" in result["error"]
        assert "Use a tensor_parallel_size in [1, 3, 6]" in result["error"]
        assert result["distributed_initialized"] is False


def test_world_size_not_multiple_of_tp_fails_before_launch():
    gpt = model({})
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(tensor_parallel_size=2),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"world size \(1 processes\) is not a multiple of .* = 2"):
        trainer.fit(gpt, datamodule=datamodule({}))


def test_registered_by_name():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="megatron_3d", logger=False)
    assert isinstance(trainer.strategy, Megatron3DStrategy)
    assert trainer._accelerator_connector.is_distributed
