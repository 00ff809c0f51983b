"""``python -m benchmarks.memory logits``: the peak memory of the output layer and its loss at Llama-3's vocabulary,
unchunked against chunked.

The unchunked head materialises the logits of every token (``[tokens, V/tp]``) and the vocab-parallel
cross-entropy its fp32 softmax; the chunked loss (``GPTConfig.loss_chunk_tokens``,
``tensor_parallel.chunked_cross_entropy``) holds the logits of one chunk of tokens at a time. For each
(tp, sequence parallelism, chunk) this measures, on the CPU, the peak of the bytes allocated during one forward
and backward of ``head + loss`` and still alive (``plan.probes.LiveStorages``: exact bytes, allocator-free),
leaving out the gradients the step leaves in ``.grad``, and prints it next to the unchunked peak of the same
layout and next to the fp32 logits of the whole sequence and of one chunk, the two sizes the peaks follow.
tp2 runs on 2 processes (``torch.distributed.run``, gloo). Example::

    python -m benchmarks.memory logits                   # vocab 128,256, 1024 tokens, hidden 64: about 1 minute
    python -m benchmarks.memory logits --tokens 1024 --chunks 256

The measurement is the package's ``lightning_megatron.plan.probes.head_loss_peak`` (``tests/test_chunked_loss.py``
holds the chunked loss to it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

from benchmarks.harness.launch import add_worker_flags, read_ranks, run_checked, torchrun
from benchmarks.harness.tables import MIB, format_rows
from benchmarks.memory import ENTRY
from lightning_megatron.plan.probes import head_loss_peak

LLAMA3_VOCAB = 128256
PAD_VOCAB = 128  # the strategy's default pad_vocab_to_multiple_of


def run_layouts(tokens: int, hidden: int, vocab: int, chunks: list[int], group=None) -> list[dict]:
    rows = []
    for sequence_parallel in (False, True) if group is not None else (False,):
        for chunk in (None, *chunks):
            rows.append(head_loss_peak(tokens=tokens, hidden=hidden, vocab=vocab, chunk_tokens=chunk, group=group,
                                       sequence_parallel=sequence_parallel, pad_vocab_to_multiple_of=PAD_VOCAB))
    return rows


def worker(result_dir: Path, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rows = run_layouts(args.tokens, args.hidden, args.vocab, args.chunks, group=dist.group.WORLD)
    (result_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(rows))
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown (torch 2.13)


def measure_tp2(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="logits-peak-") as tmp:
        cmd = torchrun(2, ENTRY, "logits", "--worker", "--result-dir", tmp, "--tokens", str(args.tokens),
                       "--hidden", str(args.hidden), "--vocab", str(args.vocab),
                       "--chunks", ",".join(map(str, args.chunks)))
        run_checked(cmd, "the tp2 workers", Path(tmp))
        return read_ranks(Path(tmp), 1)[0]  # the ranks hold the same sizes


def format_table(rows: list[dict], tokens: int) -> str:
    header = ["tp", "sp", "chunk tokens", "peak MiB/rank", "/ unchunked", "loss", "fp32 logits of all tokens MiB",
              "peak / that", "fp32 logits of a chunk MiB", "peak / that"]
    table = [header]
    baseline = {}
    for row in rows:
        key = (row["tp"], row["sequence_parallel"])
        if row["chunk_tokens"] is None:
            baseline[key] = row["peak_bytes"]
        whole = tokens * row["local_vocab"] * 4
        chunk = (row["chunk_tokens"] or 0) * row["local_vocab"] * 4
        table.append([str(row["tp"]), "yes" if row["sequence_parallel"] else "no",
                      str(row["chunk_tokens"] or "unchunked"), f"{row['peak_bytes'] / MIB:.1f}",
                      f"{row['peak_bytes'] / baseline[key]:.3f}", f"{row['loss']:.4f}", f"{whole / MIB:.1f}",
                      f"{row['peak_bytes'] / whole:.2f}", f"{chunk / MIB:.1f}" if chunk else "-",
                      f"{row['peak_bytes'] / chunk:.2f}" if chunk else "-"])
    return format_rows(table, left=(1, 2))


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the micro-batch (default 1024)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64: the head's GEMM is cheap)")
    parser.add_argument("--vocab", type=int, default=LLAMA3_VOCAB, help=f"vocabulary (default {LLAMA3_VOCAB})")
    parser.add_argument("--chunks", type=lambda text: [int(c) for c in text.split(",")], default=[128, 512],
                        help="comma list of chunk sizes in tokens (default 128,512)")
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.result_dir, args)
        return
    rows = run_layouts(args.tokens, args.hidden, args.vocab, args.chunks) + measure_tp2(args)
    print(format_table(rows, args.tokens))
    print(f"* head + summed cross-entropy, one forward and backward, fp32, {args.tokens} tokens, hidden {args.hidden}, "
          f"vocabulary {args.vocab} (padded to a multiple of tp x {PAD_VOCAB} at tp2); peak: the most bytes alive at "
          f"once among those allocated in the step, the input's and the weight's gradients left out; under sequence "
          f"parallelism a chunk is chunk tokens / tp of every rank's, gathered; torch {torch.__version__}.")

