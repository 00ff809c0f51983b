"""``python -m benchmarks.memory activations``: the bytes autograd saves for backward per rank under context
parallelism (ring and all-gather attention) and sequence parallelism, against the whole sequence on one rank.

One ``torchrun`` launch of four processes builds every layout one after the other by the strategy's own steps and
counts what one training forward + loss of one micro-batch saves (``lightning_megatron.plan.probes.SavedActivations``).
CPU only (gloo; the counting does not depend on the device, but which SDPA kernel runs, and so what it saves, does).
See ``benchmarks/README.md``. Example::

    python -m benchmarks.memory activations               # h=64, 2 layers, 8 heads, 8192 tokens: 40-90 s on 2 cores
    python -m benchmarks.memory activations --heads 4     # 2 key/value groups: tp4 replicates them
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from benchmarks.harness.launch import add_worker_flags, read_ranks, run_checked, torchrun, worker_env
from benchmarks.harness.tables import MIB, format_rows
from benchmarks.memory import ENTRY
from lightning_megatron.models.gpt import GPT
from lightning_megatron.plan.probes import SavedActivations

ACTIVATION_RANKS = 4  # every activation layout runs over the same four processes, dp filling what it leaves


# ---------------------------------------------------------------------------- the layouts
@dataclass(frozen=True)
class ActivationLayout:
    key: str
    context_parallel: int
    tensor_parallel: int = 1  # with sequence parallelism whenever > 1
    attention: str = "ring"  # the context-parallel attention: "ring" or "all_gather"
    documents: bool = False  # packed documents: document ids and restarting positions (reset_attention_mask)

    @property
    def data_parallel(self) -> int:
        return ACTIVATION_RANKS // (self.context_parallel * self.tensor_parallel)

    @property
    def label(self) -> str:
        parts = []
        if self.context_parallel > 1 or self.tensor_parallel == 1:
            parts.append(f"cp{self.context_parallel}" + {"ring": " ring", "all_gather": " all-gather"}[self.attention]
                         * (self.context_parallel > 1))
        if self.tensor_parallel > 1:
            parts.append(f"tp{self.tensor_parallel}+SP")
        if self.data_parallel > 1:
            parts.append(f"dp{self.data_parallel}")
        return " x ".join(parts) + ", packed docs" * self.documents

    def replicated_key_value_bytes(self, config, seq: int) -> float:
        """What a rank saves beyond its 1/tp share when tp exceeds the key/value groups ``g``: each rank then holds
        one whole key/value head where 1/tp would be ``g / tp`` of one (the heads are replicated, not split:
        ``tensor_parallel.styles.QueryGroupColumn``), in the two key/value-wide tensors a layer saves for attention (k
        and v: the ``qkv`` output's, or with rotary the rotated k and the compact copy of v), fp32."""
        tp, groups = self.tensor_parallel, config.query_groups
        if tp <= groups:
            return 0.0
        tokens = seq / self.context_parallel
        return config.num_layers * 2 * (tp - groups) / tp * config.head_dim * tokens * 4

    def expected(self, config, seq: int, baseline_bytes: int) -> tuple[float, str]:
        """The share of the whole-sequence rank's activations this layout should hold, and how it is made up: each
        rank holds 1/cp of the tokens, and tp+SP divides both the sequence-parallel activations (norms, residuals,
        dropout) by splitting the sequence and the tensor-parallel ones (attention, MLP, logits) by splitting the
        heads, the MLP width and the vocabulary, so 1/tp in all (Korthikanti et al. 2022), plus the replicated
        key/value heads where tp exceeds the key/value groups (:meth:`replicated_key_value_bytes`)."""
        parts = self.context_parallel * self.tensor_parallel
        share, text = 1.0 / parts, "1" if parts == 1 else f"1/{parts}"
        replicated = self.replicated_key_value_bytes(config, seq) / baseline_bytes
        if replicated:
            share, text = share + replicated, f"{text} + K/V {replicated:.3f}"
        return share, text


ACTIVATION_LAYOUTS = (
    ActivationLayout("cp1", 1),
    ActivationLayout("cp2", 2),
    ActivationLayout("cp4", 4),
    ActivationLayout("cp2-ag", 2, attention="all_gather"),
    ActivationLayout("cp4-ag", 4, attention="all_gather"),
    ActivationLayout("tp2-sp", 1, 2),
    ActivationLayout("tp4-sp", 1, 4),
    ActivationLayout("cp2-tp2-sp", 2, 2),
    # Packed documents: the document mask costs the ids only (O(S)), so each is expected at its plain row's share.
    ActivationLayout("cp1-doc", 1, documents=True),
    ActivationLayout("cp2-doc", 2, documents=True),
    ActivationLayout("cp2-ag-doc", 2, attention="all_gather", documents=True),
)


def activation_gpt_config(args: argparse.Namespace):
    """``llama-tiny`` resized by the flags: RMSNorm, rotary, SwiGLU of width 2h, heads/2 key/value groups, untied
    output layer, no dropout."""
    from lightning_megatron.models.gpt import GPTConfig

    return GPTConfig.from_name("llama-tiny", vocab_size=args.vocab, max_seq_length=args.seq, hidden_size=args.hidden,
                               num_layers=args.layers, num_heads=args.heads,
                               num_query_groups=max(1, args.heads // 2), ffn_hidden_size=2 * args.hidden,
                               dropout=0.0, attention_dropout=0.0)


# ---------------------------------------------------------------------------- the batch
def activation_batch(args: argparse.Namespace, documents: bool = False) -> dict[str, Tensor]:
    """One sample of ``--seq`` tokens, the same on every rank (so every layout computes the same loss); with
    ``documents``, packed from ~16 documents of random lengths (one starts at a token with probability 16 / seq)
    with their ids and restarting positions, as ``GPTDataModule(reset_attention_mask=True, reset_position_ids=True)``
    gives them."""
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=generator)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    if documents:
        starts = torch.rand(1, args.seq, generator=generator) < 16 / args.seq
        starts[:, 0] = True
        positions = torch.arange(args.seq)
        batch["document_ids"] = starts.long().cumsum(1) - 1
        batch["position_ids"] = positions - torch.where(starts, positions, 0).cummax(1).values
    return batch


def measure_activations(layout: ActivationLayout, args: argparse.Namespace) -> dict:
    """Build the model for ``layout`` by the strategy's own steps, cut this rank's part of the batch with the
    splitter the strategy applies, and count what one forward + loss saves for backward."""
    import torch.distributed as dist

    from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
    from lightning_megatron.parallel.initialize import initialize_parameters
    from lightning_megatron.strategy.preparation import apply_recompute, prepare_context_parallel, split_pipeline
    from lightning_megatron.tensor_parallel import parallelize

    config = ParallelConfig(tensor_parallel_size=layout.tensor_parallel, data_parallel_size=layout.data_parallel,
                            context_parallel_size=layout.context_parallel,
                            sequence_parallel=layout.tensor_parallel > 1)
    state = ParallelState.create(config, "cpu")
    module = GPT(activation_gpt_config(args))
    with torch.device("meta"):
        module.configure_model()
    rng = TensorParallelRNG(args.seed, state.tensor_parallel_rank, "cpu")
    parallelize(module, module.tensor_parallel_plan(), state, rng=rng, pad_vocab_to_multiple_of=args.pad_vocab)
    apply_recompute(module, "none", rng)
    splitter = prepare_context_parallel(module, state, layout.attention)
    split_pipeline(module, state)  # pp = 1: nothing to split
    initialize_parameters(module, args.seed, device="cpu", only_meta=True)
    module.train()
    batch = activation_batch(args, layout.documents)  # every dp rank's own one-sample batch (the same sample)
    batch = batch if splitter is None else splitter(batch)
    side = {key: value for key, value in batch.items() if key not in ("input_ids", "labels")}
    with SavedActivations(module) as saved:
        loss_sum, tokens = module.model.loss(batch["input_ids"], batch["labels"], **side)
    totals = torch.stack([loss_sum.detach().float(), tokens.float()])
    if state.replica_group is not None:  # the dp x cp ranks hold the other tokens (and copies of the sample)
        dist.all_reduce(totals, group=state.replica_group)
    del loss_sum  # drops the graph and what it saved
    return {"bytes": saved.bytes(), "attention_core": saved.bytes("attention core"), "storages": len(saved.storages),
            "tokens": int(tokens), "loss": (totals[0] / totals[1]).item()}


def activation_worker(args: argparse.Namespace) -> None:
    """Every layout, one after another over the same four processes; ``rank{r}.json`` per rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    rank = dist.get_rank()
    results = {layout.key: measure_activations(layout, args) for layout in ACTIVATION_LAYOUTS}
    (args.result_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)


# ---------------------------------------------------------------------------- the parent
def parse_args(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8, help="default 8: 4 key/value groups, which tp4 splits")
    parser.add_argument("--seq", type=int, default=8192, help="tokens of the one sample per rank (a multiple of 8)")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--pad-vocab", type=int, default=1,
                        help="Megatron3DStrategy's pad_vocab_to_multiple_of (default 1: tp=4 holds exactly a quarter "
                             "of the logits)")
    parser.add_argument("--seed", type=int, default=1234)
    add_worker_flags(parser)
    return parser.parse_args(argv)


def check_activation_args(args: argparse.Namespace) -> None:
    if args.seq % 8:  # cp4: 2 * 4 load-balanced chunks; cp2 x tp2+SP: 2 * 2 chunks, each rank's share over tp2
        sys.exit(f"--seq must be a multiple of 8 (cp4 cuts it into 8 chunks); got {args.seq}")
    if args.heads % 4 or args.vocab % 4:
        sys.exit("--heads and --vocab must divide by tp=4")


def launch_activations(args: argparse.Namespace, result_dir: Path) -> list[dict]:
    script = [ENTRY, "activations", "--worker", "--result-dir", str(result_dir),
              *(f"--{name.replace('_', '-')}={getattr(args, name)}"
                for name in ("hidden", "layers", "heads", "seq", "vocab", "pad_vocab", "seed"))]
    run_checked(torchrun(ACTIVATION_RANKS, *script), "the activations workers", result_dir, worker_env())
    return read_ranks(result_dir, ACTIVATION_RANKS)


def format_activation_table(ranks: list[dict], args: argparse.Namespace) -> str:
    header = ["layout", "tokens/rank", "activations MiB/rank", "attention core MiB", "rest MiB", "vs cp1", "expected",
              "deviation", "max/min over ranks", "loss"]
    baseline = max(r["cp1"]["bytes"] for r in ranks)
    config = activation_gpt_config(args)
    rows = [header]
    for layout in ACTIVATION_LAYOUTS:
        mine = [r[layout.key] for r in ranks]
        worst = max(mine, key=lambda m: m["bytes"])
        ratio = worst["bytes"] / baseline
        expected, expected_text = layout.expected(config, args.seq, baseline)
        rows.append([
            layout.label,
            f"{worst['tokens']:,}",
            f"{worst['bytes'] / MIB:.2f}",
            f"{worst['attention_core'] / MIB:.2f}",
            f"{(worst['bytes'] - worst['attention_core']) / MIB:.2f}",
            f"{ratio:.3f}",
            f"{expected_text} = {expected:.3f}",
            f"{100 * (ratio / expected - 1):+.1f}%",
            f"{worst['bytes'] / min(m['bytes'] for m in mine):.3f}",
            f"{worst['loss']:.4f}",
        ])
    return format_rows(rows)


def describe_activations(args: argparse.Namespace) -> str:
    config = activation_gpt_config(args)
    return (f"Llama-shaped GPT h={config.hidden_size} layers={config.num_layers} heads={config.num_heads} "
            f"kv-groups={config.query_groups} ffn={config.ffn_hidden_size} vocab={config.vocab_size} "
            f"(pad_vocab_to_multiple_of={args.pad_vocab}), one sample of {args.seq} tokens per dp rank, fp32, "
            f"dropout 0, cpu; {ACTIVATION_RANKS} processes, every layout in one torchrun launch; "
            f"torch {torch.__version__}")


def activation_footer() -> str:
    notes = [
        "activations MiB/rank: the bytes of the storages autograd saves for backward during one training forward + "
        "loss of the micro-batch (saved_tensors_hooks; each storage once, by data_ptr, with its nbytes; parameters' "
        "storages left out), on the rank with the most; attention core: the storages first saved inside "
        "CoreAttention (SDPA / ring / all-gather attention), rest: everything else (norms, qkv, rotary, MLP, "
        "residuals, logits, cross-entropy). tokens/rank: the sequence positions a rank's loss covers (tp+SP ranks "
        "hold 1/tp of them between the layers).",
        "vs cp1: over the whole-sequence rank's (cp1 x dp4). expected: 1/cp for context parallelism (each rank "
        "holds 1/cp of the tokens; the ring saves q, k, v, out, lse of its own tokens only); 1/tp for tp+SP "
        "(Korthikanti et al. 2022: SP divides the norm/residual activations by tp along the sequence, and the "
        "tensor-parallel attention, MLP and vocabulary splits divide the rest by tp; the column-parallel layers "
        "save their input's sequence chunk and gather it again in backward), plus, where tp exceeds the key/value "
        "groups, the replicated key/value heads (K/V: each rank holds a whole head where 1/tp is a fraction of "
        "one; in the k and v attention saves). deviation: measured over expected, minus 1.",
        "Not divided, so above the expected share: all-gather attention saves the gathered keys and values of the "
        "whole sequence (linear in S, 2 G d values per token).",
        "packed docs: the same sample cut into ~16 documents (document ids and restarting "
        "positions), each token attending only within its own: the mask is applied tile by tile from the ids, so "
        "the only extra is the ids themselves (8 bytes a token, one storage for all layers).",
        "max/min over ranks: the largest rank's bytes over the smallest's (every context-parallel rank holds the "
        "same number of tokens; the load-balanced chunks even out the attention work, which saved bytes do not "
        "depend on). loss: the layout's loss over every token (the same sample everywhere, so every row must agree, the packed rows among themselves).",
    ]
    return "\n".join(f"* {note}" for note in notes)


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """Launch the workers, then print the table (or, as a worker, measure every layout)."""
    args = parse_args(argv, prog)
    if args.worker:
        activation_worker(args)
        return
    check_activation_args(args)
    with tempfile.TemporaryDirectory(prefix="memory-activations-") as tmp:
        print(f"  {len(ACTIVATION_LAYOUTS)} layouts on {ACTIVATION_RANKS} ranks ...", file=sys.stderr, flush=True)
        ranks = launch_activations(args, Path(tmp))
    print(describe_activations(args))
    print(format_activation_table(ranks, args))
    print(activation_footer())
