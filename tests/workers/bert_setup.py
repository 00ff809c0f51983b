"""The tiny BERTs, data and optimiser shared by the BERT worker and its single-process references."""

from dataclasses import replace

import numpy as np
import torch
from torch.utils.data import default_collate

from lightning_megatron.data import BERTDataModule, BERTPretrainingDataset
from lightning_megatron.models import BERT, BERTConfig

SEED = 1234
STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16
PRE_NORM = BERTConfig(max_seq_length=SEQ, hidden_size=32, num_layers=2, num_heads=4)
CONFIGS = {"pre": PRE_NORM, "post": replace(PRE_NORM, norm_position="post")}
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.5
FIT = dict(steps=2, seq_length=64, global_batch_size=4, max_files=20)


def batches() -> list[dict[str, torch.Tensor]]:
    """Masked samples of random byte documents of uneven lengths, so many samples are padded."""
    rng = np.random.default_rng(SEED)
    documents = [rng.integers(0, 256, size=n).astype(np.uint16) for n in rng.integers(3, 30, size=40)]
    dataset = BERTPretrainingDataset(documents, seq_length=SEQ, seed=SEED)
    samples = [dataset[i] for i in range(STEPS * GLOBAL_BATCH)]
    return [default_collate(samples[i : i + GLOBAL_BATCH]) for i in range(0, len(samples), GLOBAL_BATCH)]


def model_loss(model, batch):
    return model.loss(batch["input_ids"], batch["labels"], attention_mask=batch["attention_mask"],
                      token_type_ids=batch["token_type_ids"], sentence_order_labels=batch["sentence_order_label"])


def optimizer(params) -> torch.optim.Optimizer:
    # eps 1e-6: the key bias has an exactly-zero gradient (see gpt_setup.optimizer).
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=1e-6)


def fit_model() -> BERT:
    # adam_eps 1e-6: with 1e-8, AdamW turns fp32 rounding in near-zero gradients into full-size updates.
    return BERT("bert-tiny", learning_rate=3e-3, warmup_steps=1, adam_eps=1e-6)


def fit_datamodule() -> BERTDataModule:
    return BERTDataModule(seq_length=FIT["seq_length"], global_batch_size=FIT["global_batch_size"],
                          max_files=FIT["max_files"], seed=3)


def fit_trainer_kwargs() -> dict:
    return dict(max_steps=FIT["steps"], limit_val_batches=2, val_check_interval=FIT["steps"], num_sanity_val_steps=0,
                gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False)
