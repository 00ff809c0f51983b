"""Pre-train a BERT with Megatron-style tensor parallelism, in plain Python (no config file).

    python examples/train_bert.py                                   # bert-tiny, tp=2 on 2 processes
    python examples/train_bert.py --tensor-parallel-size 2 --devices 4 --sequence-parallel   # dp = 4 / 2
    python examples/train_bert.py --preset bert-base --norm-position post --devices 8 --tensor-parallel-size 1

On CPUs the processes talk over gloo; with GPUs, over NCCL. The data is the Python standard
library's own source (byte-level tokens), so nothing is downloaded.
"""

import argparse

import lightning as L

import lightning_megatron as lm  # importing registers strategy="megatron_3d"
from lightning_megatron.callbacks import TokenThroughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bert-tiny", choices=sorted(lm.models.BERT_PRESETS))
    parser.add_argument("--norm-position", default="pre", choices=["pre", "post"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=16)
    args = parser.parse_args()

    L.seed_everything(1234)
    config = lm.models.BERTConfig.from_name(args.preset, norm_position=args.norm_position)
    model = lm.models.BERT(config, learning_rate=2e-3, min_learning_rate=2e-4, warmup_steps=20)
    trainer = L.Trainer(
        devices=args.devices,
        strategy=lm.Megatron3DStrategy(
            tensor_parallel_size=args.tensor_parallel_size, sequence_parallel=args.sequence_parallel
        ),
        max_steps=args.max_steps,
        val_check_interval=min(100, args.max_steps),
        limit_val_batches=20,
        gradient_clip_val=1.0,
        callbacks=[TokenThroughput()],
        default_root_dir="runs/train_bert",
    )
    datamodule = lm.data.BERTDataModule(seq_length=args.seq_length, global_batch_size=args.global_batch_size)
    trainer.fit(model, datamodule=datamodule)


if __name__ == "__main__":
    main()
