"""``ckpt_path="last"`` resumes the last run of the root directory, whatever folder its checkpoints went to.

Every shipped config leaves the ``ModelCheckpoint`` without a ``dirpath`` (Lightning's default: the logger's
new ``version_N/checkpoints``), with or without ``save_last``; Lightning itself looks for "last" only in the
new, empty version's folder and starts from step 0.
"""

import logging

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from test_checkpoint_files import RecordLosses
from test_run_lock import other_run
from workers.trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy


def fit(root, steps, callback, ckpt_path=None):
    L.seed_everything(7)
    record = RecordLosses()
    callbacks = [record] + ([ModelCheckpoint(save_last=True, every_n_train_steps=2)] if callback == "save_last" else [])
    kwargs = {**trainer_kwargs({"steps": steps}), "logger": True, "enable_checkpointing": True, "limit_val_batches": 0}
    trainer = L.Trainer(devices=1, strategy=Megatron3DStrategy(), callbacks=callbacks, default_root_dir=root, **kwargs)
    trainer.fit(model({}), datamodule=datamodule({}), ckpt_path=ckpt_path)
    return trainer, record.losses


@pytest.mark.slow
@pytest.mark.parametrize("callback", ["default", "save_last"])
def test_ckpt_path_last_resumes_the_previous_version_of_the_root_directory(tmp_path, callback, caplog):
    _, straight = fit(tmp_path / "straight", 4, callback)
    fit(tmp_path / "runs", 2, callback)  # stopped after 2 steps; its checkpoints are in version_0
    with caplog.at_level(logging.INFO):
        resumed, losses = fit(tmp_path / "runs", 4, callback, ckpt_path="last")
    assert resumed.global_step == 4 and losses == straight[2:]
    assert "version_1" in resumed.checkpoint_callback.dirpath
    name = "last.ckpt" if callback == "save_last" else "epoch=0-step=2.ckpt"
    assert f'ckpt_path="last": resuming from {tmp_path / "runs" / "lightning_logs" / "version_0" / "checkpoints" / name}' \
        in caplog.text
    # A third run resumes from the second one's checkpoint, the newest.
    with caplog.at_level(logging.INFO):
        third, losses = fit(tmp_path / "runs", 5, callback, ckpt_path="last")
    assert third.global_step == 5 and len(losses) == 1
    assert f"version_1{'/'}checkpoints" in caplog.text.split('ckpt_path="last": resuming from')[-1].splitlines()[0]


@pytest.mark.slow
def test_ckpt_path_last_does_not_resume_a_run_that_is_still_training(tmp_path):
    fit(tmp_path, 2, "save_last")
    running = other_run(tmp_path / "lightning_logs" / "version_0" / "checkpoints")  # that run, still training
    try:
        with pytest.raises(RuntimeError, match=rf'ckpt_path="last" would resume a run that is still training\. '
                                               rf'Checkpoint directory .*version_0/checkpoints is in use by another '
                                               rf'training run: pid {running.pid} on'):
            fit(tmp_path, 4, "save_last", ckpt_path="last")
    finally:
        running.kill()
        running.wait()
