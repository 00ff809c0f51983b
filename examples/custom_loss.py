"""Subclass GPT with a custom loss that stays exact under every parallel layout.

``PrefixFreeGPT`` does not train on the first ``context_tokens`` positions of each sample,
whose predictions see too little context to be worth learning from. It only edits the
labels (``-100`` = ignore) before calling the model's loss: the vocab-parallel
cross-entropy, the per-token normalisation over the global batch and the pipeline schedule
all keep working, because ``training_step`` still returns ``{"loss", "num_tokens"}``.

    python examples/custom_loss.py                     # tp=2 on 2 processes
    python examples/custom_loss.py --devices 2 --tensor-parallel-size 1 --pipeline-parallel-size 2
"""

import argparse

import lightning as L
import torch

import lightning_megatron as lm
from lightning_megatron.models.gpt import IGNORE_INDEX


class PrefixFreeGPT(lm.models.GPT):
    def __init__(self, *args, context_tokens: int = 8, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.context_tokens = context_tokens

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        labels = batch["labels"].clone()
        labels[:, : self.context_tokens] = IGNORE_INDEX
        loss_sum, num_tokens = self.model.loss(batch["input_ids"], labels)
        loss = loss_sum / num_tokens.clamp(min=1)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return {"loss": loss, "num_tokens": num_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--context-tokens", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--max-files", type=int, default=None)
    args = parser.parse_args()

    L.seed_everything(1234)
    strategy = lm.Megatron3DStrategy(tensor_parallel_size=args.tensor_parallel_size,
                                     pipeline_parallel_size=args.pipeline_parallel_size, micro_batch_size=4)
    trainer = L.Trainer(devices=args.devices, strategy=strategy, max_steps=args.max_steps,
                        val_check_interval=min(50, args.max_steps), limit_val_batches=5,
                        default_root_dir="runs/example-custom-loss")
    model = PrefixFreeGPT("gpt-tiny", context_tokens=args.context_tokens, warmup_steps=min(20, args.max_steps))
    trainer.fit(model, datamodule=lm.data.GPTDataModule(seq_length=128, global_batch_size=16,
                                                       max_files=args.max_files))


if __name__ == "__main__":
    main()
