"""A NaN/Inf loss or gradient stops the run on every rank before the optimizer steps (or skips the step
everywhere, on request), names the step and the ranks, and leaves the last good checkpoint intact.

The faults come from the model itself (``workers/nonfinite_setup.FaultyGPT``: its loss times NaN, or an
Inf gradient from a tensor hook); each run is compared with a reference run of the good steps only.
"""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision

from launch import run_job
from workers.nonfinite_setup import BAD_STEP, RecordSteps, faulty
from workers.trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.checkpoint import consolidated_state_dict
from lightning_megatron.optim.nonfinite import NonFiniteError


def fit(root, steps, *, precision="32-true", callbacks=(), clip=0.5, faults=None, plugins=None, **strategy_kwargs):
    """One process; returns the trainer, the per-step record and the NonFiniteError raised (or None)."""
    L.seed_everything(7)
    record = RecordSteps()
    kwargs = {**trainer_kwargs({"steps": steps, "clip": clip}), "enable_checkpointing": bool(callbacks),
              "limit_val_batches": 0}
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(**strategy_kwargs),
                        callbacks=[record, *callbacks], default_root_dir=root, **kwargs,
                        **({"plugins": plugins} if plugins else {"precision": precision}))
    error = None
    try:
        trainer.fit(faulty(model({}), **(faults or {})), datamodule=datamodule({}))
    except NonFiniteError as exception:
        error = exception
    return trainer, record, error


def assert_same_weights(trainer, reference):
    ours, theirs = trainer.lightning_module.state_dict(), reference.lightning_module.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, theirs[name]), name
    if reference.strategy.driver.main_params is not None:  # 16-bit parameters: the fp32 main copies too
        for (_, a), (_, b) in zip(trainer.strategy.driver.main_params.pieces, reference.strategy.driver.main_params.pieces):
            assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_nan_loss_stops_before_the_step_and_the_last_good_checkpoint_stays(tmp_path, precision):
    bad = 3
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=1)
    trainer, record, error = fit(tmp_path / "bad", 6, precision=precision, callbacks=[checkpoints],
                                 faults={"nan_steps": [bad]})
    assert error is not None, "the run trained on through a NaN loss"
    message = str(error)
    assert f"global step {bad} (epoch 0)" in message and "loss is nan on ranks [0]" in message, message
    assert "did not step" in message and "on_nonfinite='skip'" in message, message
    assert len(record.losses) == bad and all(record.finite), "a step after the NaN finished"
    reference, _, no_error = fit(tmp_path / "reference", bad, precision=precision)
    assert no_error is None
    assert_same_weights(trainer, reference)
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == [f"epoch=0-step={bad}.ckpt"], saved  # the last good step's, and nothing after it
    state = consolidated_state_dict(tmp_path / "ckpt" / saved[0])
    full = reference.strategy.full_state_dict()
    assert state.keys() == full.keys()
    for name, value in state.items():
        assert torch.isfinite(value).all() and torch.equal(value, full[name]), name


@pytest.mark.slow
def test_an_inf_gradient_with_a_finite_loss_is_caught(tmp_path):
    trainer, record, error = fit(tmp_path / "bad", 4, faults={"inf_grad_steps": [1]})
    assert error is not None, "the run trained on through an Inf gradient"
    assert "global step 1" in str(error), str(error)
    assert "the loss is finite on every rank; gradients non-finite on ranks [0]" in str(error), str(error)
    assert all(math.isfinite(loss) for loss in record.losses)
    reference, _, _ = fit(tmp_path / "reference", 1)
    assert_same_weights(trainer, reference)


@pytest.mark.slow
def test_skip_mode_skips_exactly_the_bad_steps_and_trains_on(tmp_path):
    """Two bad steps, not in a row: both are skipped even with max_consecutive_skips=1."""
    bad_steps = (1, 3)
    trainer, record, error = fit(tmp_path, 6, on_nonfinite="skip", max_consecutive_skips=1,
                                 faults={"nan_steps": bad_steps})
    assert error is None
    assert len(record.checksums) == 6 and all(record.finite)
    for step in range(1, 6):
        changed = record.checksums[step] != record.checksums[step - 1]
        assert changed == (step not in bad_steps), (step, record.checksums)
    assert all(math.isnan(loss) == (step in bad_steps) for step, loss in enumerate(record.losses)), record.losses
    assert trainer.strategy.driver.nonfinite.skipped_steps == 2
    assert float(trainer.callback_metrics["skipped_steps"]) == 2.0


@pytest.mark.slow
def test_skip_mode_raises_once_more_steps_in_a_row_are_bad_than_allowed(tmp_path):
    trainer, record, error = fit(tmp_path / "bad", 8, on_nonfinite="skip", max_consecutive_skips=2,
                                 faults={"nan_steps": range(2, 8)})
    assert error is not None, "the run skipped on forever"
    message = str(error)
    assert "global step 4" in message and "3 non-finite steps in a row" in message, message
    assert "max_consecutive_skips=2" in message, message
    assert len(record.checksums) == 4 and record.checksums[1] == record.checksums[2] == record.checksums[3]
    assert trainer.strategy.driver.nonfinite.skipped_steps == 2
    reference, _, _ = fit(tmp_path / "reference", 2)  # skipped steps changed nothing
    assert_same_weights(trainer, reference)


@pytest.mark.slow
def test_fp16_mixed_keeps_its_grad_scaler_skipping_the_step(tmp_path):
    """16-mixed: gradients are still scaled when the check would run and an inf is an expected overflow;
    Lightning's GradScaler skips the step, so the check stays out of the way."""
    fp16 = MixedPrecision("16-mixed", "cpu")  # the string "16-mixed" would turn into bf16-mixed on the CPU
    trainer, record, error = fit(tmp_path, 3, plugins=[fp16], on_nonfinite="error", faults={"nan_steps": [1]})
    assert error is None
    assert trainer.precision_plugin.scaler is not None and trainer.precision_plugin.scaler.get_scale() < 2.0**16
    assert record.checksums[1] == record.checksums[0] != record.checksums[2]
    assert all(record.finite)


@pytest.mark.parametrize("kwargs, match", [
    ({"on_nonfinite": "raise"}, r"on_nonfinite='raise' is not one of \('error', 'skip', 'ignore'\)"),
    ({"on_nonfinite": "skip", "max_consecutive_skips": 0}, r"max_consecutive_skips must be a positive integer, got 0"),
])
def test_bad_settings_are_refused_when_the_strategy_is_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Megatron3DStrategy(**kwargs)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    results, _ = run_job("nonfinite_fit", 2, tmp_path_factory.mktemp("nonfinite"), timeout=600)
    assert len(results) == 2
    return results


@pytest.mark.slow
@pytest.mark.parametrize("run", ["dp2-nan", "zero3-nan", "pp2-nan"])
def test_a_nan_loss_on_one_rank_stops_every_rank_with_the_same_error_naming_it(two_ranks, run):
    errors = [ranks[run]["error"] for ranks in two_ranks]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith("NonFiniteError: ") and f"global step {BAD_STEP}" in errors[0], errors[0]
    if run == "pp2-nan":  # the pipeline ran backward before training_step returned: the gradients are fine
        assert "loss is nan on ranks [1]." in errors[0], errors[0]
    else:  # the dp all-reduce (ZeRO-3: reduce-scatter) spread the NaN gradients to rank 0
        assert "loss is nan on ranks [1]; gradients non-finite on ranks [0, 1]." in errors[0], errors[0]
    for ranks in two_ranks:
        assert len(ranks[run]["checksums"]) == BAD_STEP and all(ranks[run]["finite"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2-bf16-inf-grad-skip", "dp2-zero1-overlap-inf-grad-skip"])
def test_an_inf_gradient_on_one_rank_is_skipped_on_every_rank(two_ranks, name):
    for ranks in two_ranks:
        run = ranks[name]
        assert run["error"] is None and run["skipped"] == 1 and all(run["finite"])
        checksums = run["checksums"]
        assert [a == b for a, b in zip(checksums, checksums[1:])] == [step == BAD_STEP for step in range(1, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "dp2-zero1", "dp2-zero3", "tp2"])
def test_clipping_by_the_checked_norm_gives_the_unchecked_losses(two_ranks, layout):
    """The clip reuses the norm the check measured; under SGD a wrongly counted norm changes every update."""
    for ranks in two_ranks:
        checked, unchecked = ranks[f"clip-{layout}-error"], ranks[f"clip-{layout}-ignore"]
        assert checked["error"] is None and len(checked["losses"]) == 3
        assert checked["losses"] == pytest.approx(unchecked["losses"], rel=1e-6, abs=0)
        assert checked["checksums"] == pytest.approx(unchecked["checksums"], rel=1e-6, abs=0)


@pytest.mark.slow
def test_the_check_without_clipping_gives_the_unchecked_losses(two_ranks):
    """Clipping off: the check measures a norm of its own and must change nothing (what the retired
    ``benchmarks/nonfinite_check.py`` smoke test compared, there in one process)."""
    for ranks in two_ranks:
        checked, unchecked = ranks["noclip-dp2-error"], ranks["noclip-dp2-ignore"]
        assert checked["error"] is None and len(checked["losses"]) == 3
        assert checked["losses"] == unchecked["losses"] and checked["checksums"] == unchecked["checksums"]
