"""Train a GPT with Megatron-style 3D parallelism from plain Python, no config file.

    python examples/train_gpt.py                                          # gpt-tiny, tp=2 on 2 processes
    python examples/train_gpt.py --preset llama-tiny --sequence-parallel  # Llama-shaped: RMSNorm, rotary, SwiGLU, GQA
    python examples/train_gpt.py --devices 8 --tensor-parallel-size 2 --pipeline-parallel-size 2   # dp = 2
    python examples/train_gpt.py --devices 4 --zero-stage 1 --precision bf16-true --tensor-parallel-size 1

``--preset`` takes any name of ``GPTConfig.presets()``: the GPT-2 / Megatron-LM shapes and the
Llama-shaped ones (``llama-tiny``, 2 key/value heads for 4 query heads, so tp=2 hands each rank
one whole group; the published shapes ``llama-3.2-1b``, ``llama-3.1-8b``, ``mistral-7b``, ...
are for GPUs: see their layouts in ``configs/``). On CPUs the processes talk over gloo; with
GPUs, over NCCL. The data is the Python standard library's own source (byte-level tokens), so
nothing is downloaded.
"""

import argparse

import lightning as L

import lightning_megatron as lm  # importing registers strategy="megatron_3d"
from lightning_megatron.callbacks import TokenThroughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-tiny", choices=sorted(lm.models.GPT_PRESETS),
                        help="a GPTConfig preset, e.g. gpt-tiny or llama-tiny")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--max-files", type=int, default=None, help="use only this many stdlib files")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=16)
    args = parser.parse_args()

    L.seed_everything(1234)
    strategy = lm.Megatron3DStrategy(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        micro_batch_size=args.micro_batch_size,
        sequence_parallel=args.sequence_parallel,
        zero_stage=args.zero_stage,
    )
    trainer = L.Trainer(
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=min(100, args.max_steps),
        limit_val_batches=10,
        gradient_clip_val=1.0,
        callbacks=[TokenThroughput()],
        default_root_dir="runs/example-gpt",
    )
    model = lm.models.GPT(args.preset, learning_rate=2e-3, min_learning_rate=2e-4, warmup_steps=min(40, args.max_steps))
    data = lm.data.GPTDataModule(seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                                 max_files=args.max_files)
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
