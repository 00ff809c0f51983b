"""Mixture of Experts: tokens/s and per-rank expert bytes at ep 1/2/4, load balance, loop vs grouped GEMM.

Four tables from one invocation, each comparing its sides in the same run:

(1) **Expert parallelism.** One Llama-shaped MoE GPT (every layer MoE, 8 experts top-2) trained with
    the real ``Trainer`` + ``Megatron3DStrategy(expert_parallel_size=ep)`` at ep = 1, 2, 4 on the same
    4 ranks (dp=4: ep is carved out of dp, so the global batch, the data and the math are the same at
    every ep). One ``torchrun`` launch runs every layout in the same processes, in ABBA order over the
    rounds, so drift on a shared machine falls on every layout alike. Per layout: tokens/s (median step
    of the slowest rank, best round), the exact per-rank bytes of the expert parameters, their gradients
    and Adam state (parameters under ``.experts.``), ``strategy.model_state_bytes`` (all of the rank's
    model state), ratios against ep=1, and rank 0's last loss (must agree across layouts).
(2) **Load balance.** One process, a plain loop (``GPTModel`` + AdamW) on byte tokens of the built-in
    corpus, the same seed and batches under ``aux_loss_coeff`` 0, 1e-2 (Megatron-Core's usual value) and
    1e-1, ``expert_bias=True`` (aux-loss-free), and each family's router as its published config sets it
    (Qwen3-MoE: renormalised, 1e-3): the max/mean expert load of each layer over each
    step's batch (a forward hook on every ``TopKRouter``), at the first step and over the last steps,
    and the band each run ends in.
(3) **Loop vs grouped GEMM.** Forward + backward of E_local SwiGLU experts on the tokens a rank holds
    after dispatch: the ``MoE`` layer's loop over its ``nn.Linear`` experts against
    ``torch.stack`` of their weights + ``F.grouped_mm`` (what a grouped GEMM costs with the per-expert
    parameters the checkpoints are keyed by), and ``F.grouped_mm`` on weights already stored stacked
    (the best a layout change could give). Same inputs, outputs checked equal; one thread, like a rank.
(4) **The families' routers.** The model of (2) with each family's router as its preset sets it (Mixtral's softmax
    top-2, Qwen3-MoE's renormalised top-k over many experts, GPT-OSS's softmax of the top-k logits with a router
    bias, DeepSeek-V3's sigmoid group-limited top-k with the score-correction bias and routed scaling): per-expert
    load over the last steps, min/mean, max/mean and CV of the worst layer, and every token's top-k assignments.

Example::

    python -m benchmarks.moe            # about 2 minutes on 2 idle cores
    python -m benchmarks.moe --quick    # tiny settings, well under a minute (tests/test_benchmarks.py)
    python -m benchmarks.moe --only grouped
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import asdict, replace
from typing import Callable, Optional

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.data.corpus import load_stdlib_token_documents
from lightning_megatron.models.gpt import GPT, GPTConfig, GPTModel
from lightning_megatron.models.mlp import GatedMLP
from lightning_megatron.models.moe import MoEConfig, update_expert_biases
from lightning_megatron.models.router import TopKRouter
from benchmarks.harness.launch import add_worker_flags, read_ranks, run_checked, torchrun
from benchmarks.harness.rounds import abba, slowest_rank_median
from benchmarks.harness.tables import MIB, format_rows
from benchmarks.harness.training import quiet_trainer
RANKS = 4
EXPERT_PARALLEL_SIZES = (1, 2, 4)
SECTIONS = ("ep", "balance", "grouped", "routers")


# ---------------------------------------------------------------------------- arguments and sizes
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps: seconds per table")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these tables")
    parser.add_argument("--seed", type=int, default=1234)
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    quick = args.quick
    # (1) expert parallelism: per-rank batch, steps per run, rounds (every layout once per round)
    args.seq, args.batch = (32, 2) if quick else (128, 4)
    args.warmup, args.steps, args.rounds = (1, 2, 1) if quick else (2, 8, 3)
    # (2) load balance
    args.balance_steps, args.balance_batch, args.balance_seq = (10, 4, 32) if quick else (200, 8, 128)
    # (4) the families' routers: steps (the same batches as (2))
    args.router_steps = 4 if quick else 200
    # (3) loop vs grouped GEMM: assignments a rank's experts get, rounds
    args.assignments, args.grouped_rounds = ((256,), 3) if quick else ((1024, 8192), 25)
    return args


def moe_config(args: argparse.Namespace, **moe: object) -> GPTConfig:
    """Llama-shaped (RMSNorm, rotary, SwiGLU experts, untied head), byte vocabulary; every layer MoE, 8 experts
    top-2 unless ``moe`` says otherwise."""
    experts = MoEConfig(**{"num_experts": 8, "top_k": 2, "ffn_hidden_size": 64 if args.quick else 128, **moe})
    return GPTConfig.from_name("llama-tiny", hidden_size=64, num_layers=2 if args.quick else 4, num_heads=4,
                               num_query_groups=2, ffn_hidden_size=176, max_seq_length=max(args.seq, args.balance_seq),
                               moe=experts)


def corpus_tokens(count: int) -> Tensor:
    """The first ``count`` byte tokens of the built-in corpus (the standard library's source), repeated if short."""
    documents = load_stdlib_token_documents(max_files=200)
    tokens = torch.from_numpy(np.concatenate(documents).astype(np.int64))
    return tokens.repeat(count // len(tokens) + 1)[:count]


def corpus_windows(samples: int, seq: int) -> tuple[Tensor, Tensor]:
    """``samples`` consecutive windows of ``seq + 1`` tokens: (input ids, labels)."""
    windows = corpus_tokens(samples * (seq + 1)).view(samples, seq + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


# ---------------------------------------------------------------------------- (1) expert parallelism: worker
class Windows(Dataset):
    def __init__(self, samples: int, seq: int) -> None:
        self.input_ids, self.labels = corpus_windows(samples, seq)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


class Probe(L.Callback):
    """Step clock (start of a step to the next one's start; the last to its end), and the bytes of the first step:
    the experts' gradients just before the optimizer step (the strategy drops ``.grad`` after it), everything else
    once the step is done and the optimizer state exists."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.first, self.last = warmup, warmup + steps - 1
        self.marks: list[float] = []
        self.bytes: dict[str, int] = {}
        self.grad_bytes = 0
        self.loss = float("nan")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:  # the gradients of the first step, reduced; dropped once the step is done
            self.grad_bytes = sum(p.grad.numel() * p.grad.element_size() for name, p in pl_module.named_parameters()
                                  if ".experts." in name and p.grad is not None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.first <= batch_idx <= self.last:
            self.marks.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if batch_idx == self.last:
            self.marks.append(time.perf_counter())
        self.loss = float(outputs["loss"])
        if batch_idx == 0:
            self.bytes = {"model_state": sum(trainer.strategy.model_state_bytes.values()),
                          **expert_bytes(pl_module, trainer.optimizers[0]), "expert_grads": self.grad_bytes}


def expert_bytes(module: nn.Module, optimizer) -> dict[str, int]:
    """This rank's bytes of its routed experts' parameters and their optimizer state (Adam's moments)."""
    experts = [p for name, p in module.named_parameters() if ".experts." in name]
    state = getattr(optimizer, "_optimizer", optimizer).state
    moments = [v for p in experts for v in state.get(p, {}).values() if isinstance(v, Tensor) and v.dim() > 0]
    return {
        "expert_params": sum(p.numel() * p.element_size() for p in experts),
        "expert_optim": sum(v.numel() * v.element_size() for v in moments),
        "expert_modules": sum(1 for name, _ in module.named_parameters()
                              if ".experts." in name and name.endswith(".fc.weight")),
    }


def fit_once(args: argparse.Namespace, ep: int, rank: int) -> dict:
    L.seed_everything(args.seed, verbose=False)  # the same initial weights at every layout
    dataset = Windows((args.warmup + args.steps) * args.batch * RANKS, args.seq)
    sampler = DistributedSampler(dataset, num_replicas=RANKS, rank=rank, shuffle=False)  # dp rank = rank (tp=pp=1)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
    probe = Probe(args.warmup, args.steps)
    trainer = quiet_trainer(strategy=Megatron3DStrategy(expert_parallel_size=ep), accelerator="cpu", devices=RANKS,
                            precision="32-true", max_steps=args.warmup + args.steps, callbacks=[probe])
    trainer.fit(GPT(moe_config(args), warmup_steps=args.warmup + args.steps), loader)
    step_seconds = [b - a for a, b in zip(probe.marks, probe.marks[1:])]
    return {"ep": ep, "step_seconds": step_seconds, "bytes": probe.bytes, "loss": probe.loss}


def worker_main(args: argparse.Namespace) -> None:
    """Every layout, ``rounds`` times in ABBA order, in this one process; ``rank{r}.json`` for the parent."""
    rank = int(os.environ["RANK"])
    runs = []
    for round_ in range(args.rounds):
        for ep in abba(EXPERT_PARALLEL_SIZES, round_):
            runs.append(fit_once(args, ep, rank))
    (args.result_dir / f"rank{rank}.json").write_text(json.dumps(runs))


# ---------------------------------------------------------------------------- (1) expert parallelism: parent
def launch_layouts(args: argparse.Namespace) -> list[list[dict]]:
    """The per-rank results of one 4-rank launch that runs every layout."""
    with tempfile.TemporaryDirectory(prefix="moe-") as tmp:
        cmd = torchrun(RANKS, __spec__.name, *(["--quick"] if args.quick else []), f"--seed={args.seed}",
                       "--worker", f"--result-dir={tmp}")
        run_checked(cmd, "the expert-parallel launch", Path(tmp))
        return read_ranks(Path(tmp), RANKS)


def layout_table(args: argparse.Namespace, ranks: list[list[dict]]) -> str:
    tokens_per_step = args.batch * args.seq * RANKS
    rows = {}
    for ep in EXPERT_PARALLEL_SIZES:
        per_rank = [[run for run in runs if run["ep"] == ep] for runs in ranks]  # [rank][round]
        speeds = []
        for rounds in zip(*per_rank):  # one round, every rank
            speeds.append(tokens_per_step / slowest_rank_median([run["step_seconds"] for run in rounds]))
        sizes = [runs[0]["bytes"] for runs in per_rank]  # every rank's, first round
        worst = max(sizes, key=lambda s: s["model_state"])
        same = all(s == sizes[0] for s in sizes)
        expert_state = worst["expert_params"] + worst["expert_grads"] + worst["expert_optim"]
        rows[ep] = dict(speed=max(speeds), slowest=min(speeds), sizes=worst, same=same, expert_state=expert_state,
                        loss=per_rank[0][-1]["loss"])
    base = rows[1]
    header = ["ep", "experts/layer/rank", "tokens/s", "slowest round", "tok/s vs ep1", "expert params MiB",
              "params vs ep1", "expert state MiB", "model state MiB", "state vs ep1", "non-expert MiB", "ranks equal",
              "last loss"]
    num_experts, num_layers = moe_config(args).moe.num_experts, moe_config(args).num_layers
    table = [header]
    for ep, row in rows.items():
        sizes = row["sizes"]
        table.append([
            str(ep), f"{sizes['expert_modules'] // num_layers} of {num_experts}", f"{row['speed']:,.0f}",
            f"{row['slowest']:,.0f}",
            f"{row['speed'] / base['speed']:.3f}",
            f"{sizes['expert_params'] / MIB:.4f}", f"{sizes['expert_params'] / base['sizes']['expert_params']:.3f}",
            f"{row['expert_state'] / MIB:.4f}",
            f"{sizes['model_state'] / MIB:.4f}", f"{sizes['model_state'] / base['sizes']['model_state']:.3f}",
            f"{(sizes['model_state'] - row['expert_state']) / MIB:.4f}",
            "yes" if row["same"] else "no", f"{row['loss']:.5f}",
        ])
    bytes_line = "; ".join(f"ep{ep}: expert params {row['sizes']['expert_params']:,} B, expert state "
                           f"{row['expert_state']:,} B, model state {row['sizes']['model_state']:,} B"
                           for ep, row in rows.items())
    config = moe_config(args)
    notes = [
        f"Model: {describe(config)}; {RANKS} ranks (dp={RANKS}, tp=pp=1), per-rank batch {args.batch} x {args.seq} "
        f"tokens of the built-in corpus, fp32, AdamW, Trainer + Megatron3DStrategy(expert_parallel_size=ep), gloo, "
        f"one thread per rank.",
        f"tokens/s: {tokens_per_step} global tokens per step over the median step ({args.steps} steps after "
        f"{args.warmup} warm-up) of the slowest rank; best of {args.rounds} round(s), the layouts in ABBA order in the "
        f"same processes. {RANKS} ranks share {os.cpu_count()} cores: on CPU the all-to-all is memcpy through gloo's "
        f"sockets, so this measures the dispatcher's overhead, not what ep buys on GPUs.",
        "Bytes per rank after the first step (every rank; 'ranks equal' says whether they all hold the same): expert "
        "params = parameters under '.experts.'; expert state = those parameters + their gradients + their Adam "
        "moments; model state = sum of strategy.model_state_bytes (parameters, gradients, main parameters, optimizer "
        "state); non-expert = model state - expert state. Exact: " + bytes_line + ".",
        "last loss: rank 0's training loss at the last step; the layouts compute the same model, so it must agree.",
    ]
    return format_rows(table) + "\n" + "\n".join(f"* {note}" for note in notes)


def describe(config: GPTConfig) -> str:
    moe = config.moe
    return (f"Llama-shaped h={config.hidden_size} layers={config.num_layers} (all MoE) heads={config.num_heads} "
            f"kv_heads={config.query_groups} vocab={config.vocab_size}, {moe.num_experts} SwiGLU experts "
            f"top-{moe.top_k} of width {moe.ffn_hidden_size} ({config.num_parameters() / 1e6:.2f}M params, "
            f"{config.num_active_parameters() / 1e6:.2f}M active)")


# ---------------------------------------------------------------------------- (2) load balance
BALANCE_VARIANTS: dict[str, dict] = {
    "aux 0": dict(aux_loss_coeff=0.0),
    "aux 1e-2": dict(aux_loss_coeff=1e-2),
    "aux 1e-1": dict(aux_loss_coeff=1e-1),
    "expert_bias (aux-free)": dict(expert_bias=True),
    # Qwen3-MoE's router (Qwen3-30B-A3B's config): softmax, top-k weights renormalised, router_aux_loss_coef 1e-3
    "qwen3-moe router": dict(normalize_topk=True, aux_loss_coeff=1e-3),
}


def train_balance(args: argparse.Namespace, moe: dict, input_ids: Tensor, labels: Tensor) -> dict:
    """A plain loop; per step and layer, the max/mean tokens per expert over the step's batch."""
    config = moe_config(args, **moe)
    torch.manual_seed(args.seed)
    model = GPTModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    step_counts: list[Tensor] = []

    def record(router, inputs, routing) -> None:
        step_counts.append(torch.bincount(routing.expert_ids.reshape(-1), minlength=router.num_experts).float())

    hooks = [router.register_forward_hook(record) for router in routers]
    loads, balance, losses, per_expert = [], [], [], []
    for step in range(args.balance_steps):
        rows = slice(step * args.balance_batch, (step + 1) * args.balance_batch)
        step_counts.clear()
        loss_sum, tokens = model.loss(input_ids[rows], labels[rows])
        (loss_sum / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if config.moe.expert_bias:
            update_expert_biases(model, config.moe.expert_bias_update_rate)
        counts = torch.stack(step_counts)  # [layers, E]
        per_expert.append(counts)
        loads.append((counts.max(dim=1).values / counts.mean(dim=1)).tolist())
        balance.append(float(model.moe_aux_losses.statistics()[0]))
        losses.append(float(loss_sum.detach() / tokens))
    for hook in hooks:
        hook.remove()
    return {"loads": loads, "balance": balance, "losses": losses, "counts": per_expert}


def balance_table(args: argparse.Namespace) -> str:
    input_ids, labels = corpus_windows(args.balance_steps * args.balance_batch, args.balance_seq)
    runs = {name: train_balance(args, moe, input_ids, labels) for name, moe in BALANCE_VARIANTS.items()}
    tail = max(1, args.balance_steps // 10)

    def mean(values) -> float:
        return sum(values) / len(values)

    rows = [["over each step's batch", *runs]]
    summaries = {}
    for name, run in runs.items():
        last = run["loads"][-tail:]
        summaries[name] = dict(
            first_mean=mean(run["loads"][0]), first_worst=max(run["loads"][0]),
            last_mean=mean([mean(step) for step in last]), last_worst=max(max(step) for step in last),
            last_worst_typical=mean([max(step) for step in last]),
            balance_first=run["balance"][0], balance_last=mean(run["balance"][-tail:]),
            loss_last=mean(run["losses"][-tail:]),
        )
    measures = [
        ("max/mean load, step 1, mean of layers", "first_mean", "{:.3f}"),
        ("max/mean load, step 1, worst layer", "first_worst", "{:.3f}"),
        (f"max/mean load, last {tail} steps, mean of layers", "last_mean", "{:.3f}"),
        (f"max/mean load, last {tail} steps, worst layer (mean)", "last_worst_typical", "{:.3f}"),
        (f"max/mean load, last {tail} steps, worst layer (max)", "last_worst", "{:.3f}"),
        ("load-balancing value, step 1 (1.0 = uniform)", "balance_first", "{:.4f}"),
        (f"load-balancing value, last {tail} steps", "balance_last", "{:.4f}"),
        (f"LM loss, last {tail} steps", "loss_last", "{:.4f}"),
    ]
    for label, key, fmt in measures:
        rows.append([label, *(fmt.format(summaries[name][key]) for name in runs)])
    config = moe_config(args)
    tokens = args.balance_batch * args.balance_seq
    band = "; ".join(f"{name}: every layer's max load <= {s['last_worst']:.2f}x the mean (layers' mean "
                     f"{s['last_mean']:.2f}x)" for name, s in summaries.items())
    notes = [
        f"Model: {describe(config)}; one process, GPTModel + AdamW(lr 1e-3, betas 0.9/0.95, wd 0.1), "
        f"{args.balance_steps} steps of {args.balance_batch} x {args.balance_seq} = {tokens} byte tokens of the "
        f"built-in corpus (the same seed and batches in every column); expert_bias_update_rate "
        f"{config.moe.expert_bias_update_rate}.",
        f"load = tokens routed to an expert (top-{config.moe.top_k} assignments) over the step's batch, from a forward "
        f"hook on each TopKRouter; max/mean = the most loaded expert over the average (1.0: even; "
        f"{config.moe.num_experts / config.moe.top_k:.0f}.0: every token on the same experts).",
        f"Band over the last {tail} steps: {band}.",
    ]
    return format_rows(rows) + "\n" + "\n".join(f"* {note}" for note in notes)


# ---------------------------------------------------------------------------- (4) the families' routers
def family_routers() -> dict[str, MoEConfig]:
    """Each family's router as its published preset sets it (``GPTConfig`` presets), at the benchmark's width: Mixtral's
    softmax top-2 of 8 (renormalised), Qwen3-MoE's renormalised softmax top-k over many experts (top-4 of 32: its
    1 in 16), GPT-OSS-20B's softmax of the top-4 logits of 32 with the router's bias, DeepSeek-V3's sigmoid scores,
    group-limited top-k (the tiny preset's 2 groups, 1 kept) with the aux-loss-free score-correction bias and the
    routed scaling 2.5. The experts' widths and layer pattern are the benchmark's (every layer MoE)."""
    presets = {"mixtral": (GPTConfig.from_name("mixtral-tiny").moe, {}),
               "qwen3-moe": (GPTConfig.from_name("qwen3-30b-a3b").moe, dict(num_experts=32, top_k=4)),
               "gpt-oss": (GPTConfig.from_name("gpt-oss-20b").moe, {}),
               "deepseek-v3": (GPTConfig.from_name("deepseek-v3-tiny").moe, dict(shared_expert_size=0))}
    return {name: replace(moe, layer_freq=1, **changes) for name, (moe, changes) in presets.items()}


def router_table(args: argparse.Namespace) -> str:
    """Per family: the tokens each expert received over the last steps (per layer), as min/mean, max/mean and the
    coefficient of variation (std/mean), the worst layer's; every token's ``top_k`` assignments are counted."""
    input_ids, labels = corpus_windows(args.router_steps * args.balance_batch, args.balance_seq)
    tail = max(1, args.router_steps // 2)
    rows = [["router", "experts", "top-k", "assignments/layer", "min/mean load", "max/mean load", "CV of load",
             "LM loss, last"]]
    for name, moe in family_routers().items():
        fields = asdict(moe)
        del fields["ffn_hidden_size"]  # the benchmark model's own
        run = train_balance(argparse.Namespace(**{**vars(args), "balance_steps": args.router_steps}), fields,
                            input_ids, labels)
        loads = torch.stack(run["counts"][-tail:]).sum(dim=0)  # [layers, E] over the last steps
        mean = loads.mean(dim=1)
        assignments = {int(total) for total in loads.sum(dim=1)}
        rows.append([name, str(moe.num_experts), str(moe.top_k), ",".join(f"{a:,}" for a in sorted(assignments)),
                     f"{float((loads.min(dim=1).values / mean).min()):.3f}",
                     f"{float((loads.max(dim=1).values / mean).max()):.3f}",
                     f"{float((loads.std(dim=1, unbiased=False) / mean).max()):.3f}", f"{run['losses'][-1]:.4f}"])
    tokens = args.balance_batch * args.balance_seq
    notes = [f"Model: as (2), every layer MoE with each family's router (its preset's MoEConfig: score function, "
             f"renormalisation, router bias, groups, score-correction bias and its update, scaling, aux-loss "
             f"coefficient); {args.router_steps} steps of {tokens} byte tokens, the same batches for every router.",
             f"load = tokens routed to an expert over the last {tail} steps, per layer; the worst layer's min/mean, "
             f"max/mean and CV (std/mean; 0: even). assignments/layer = tokens x top-k x {tail} steps: every token "
             f"reaches exactly top-k experts."]
    return format_rows(rows) + "\n" + "\n".join(f"* {note}" for note in notes)


# ---------------------------------------------------------------------------- (3) loop vs grouped GEMM
def loop_experts(experts: list[GatedMLP], tokens: Tensor, counts: list[int]) -> Tensor:
    """What ``MoE._routed_experts`` does with a rank's tokens, grouped by local expert."""
    return torch.cat([expert(part) for expert, part in zip(experts, tokens.split(counts))])


def grouped_experts(fc: Tensor, proj: Tensor, tokens: Tensor, offsets: Tensor) -> Tensor:
    """The same with two grouped GEMMs: ``fc`` ``[E, 2f, h]`` and ``proj`` ``[E, h, f]`` (``nn.Linear`` layout)."""
    gate, up = F.grouped_mm(tokens, fc.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    return F.grouped_mm(F.silu(gate) * up, proj.transpose(1, 2), offs=offsets)


def grouped_table(args: argparse.Namespace) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what a rank gets under torchrun (OMP_NUM_THREADS=1)
    try:
        return _grouped_table(args)
    finally:
        torch.set_num_threads(threads)


def _grouped_table(args: argparse.Namespace) -> str:
    config = moe_config(args)
    hidden, ffn, num_experts = config.hidden_size, config.moe.ffn_hidden_size, config.moe.num_experts
    header = ["E_local", "assignments", "loop ms", "stack+grouped ms", "ratio", "stacked grouped ms", "ratio",
              "same result"]
    rows = [header]
    ratios = []
    for local in (num_experts, num_experts // 2, num_experts // 4):
        for assignments in args.assignments:
            generator = torch.Generator().manual_seed(args.seed + local + assignments)
            experts = [GatedMLP(hidden, ffn) for _ in range(local)]
            stacked_fc = nn.Parameter(torch.stack([e.fc.weight.detach() for e in experts]))
            stacked_proj = nn.Parameter(torch.stack([e.proj.weight.detach() for e in experts]))
            counts = torch.bincount(torch.randint(local, (assignments,), generator=generator), minlength=local)
            offsets = counts.cumsum(0).to(torch.int32)
            counts = counts.tolist()
            tokens = torch.randn(assignments, hidden, generator=generator)
            grad = torch.randn(assignments, hidden, generator=generator)
            sides: dict[str, Callable[[Tensor], Tensor]] = {
                "loop": lambda x: loop_experts(experts, x, counts),
                "stack": lambda x: grouped_experts(torch.stack([e.fc.weight for e in experts]),
                                                   torch.stack([e.proj.weight for e in experts]), x, offsets),
                "stacked": lambda x: grouped_experts(stacked_fc, stacked_proj, x, offsets),
            }
            separate = [p for e in experts for p in e.parameters()]
            params = {"loop": separate, "stack": separate, "stacked": [stacked_fc, stacked_proj]}

            def weight_grads(side: str) -> Tensor:
                if side == "stacked":
                    return torch.cat([stacked_fc.grad.flatten(), stacked_proj.grad.flatten()])
                return torch.cat([torch.stack([e.fc.weight.grad for e in experts]).flatten(),
                                  torch.stack([e.proj.weight.grad for e in experts]).flatten()])

            def step(side: str) -> tuple[float, list[Tensor]]:
                for p in params[side]:
                    p.grad = None
                x = tokens.clone().requires_grad_()
                start = time.perf_counter()
                out = sides[side](x)
                out.backward(grad)
                return time.perf_counter() - start, [out.detach(), x.grad, weight_grads(side)]

            results = {side: step(side)[1] for side in sides}  # warm-up, and the results compared
            same = all(torch.allclose(mine, theirs, atol=1e-5)
                       for side in sides for mine, theirs in zip(results[side], results["loop"]))
            times: dict[str, list[float]] = {side: [] for side in sides}
            for round_ in range(args.grouped_rounds):
                for side in abba(list(sides), round_):
                    times[side].append(step(side)[0])
            ms = {side: min(t) * 1e3 for side, t in times.items()}  # noise only ever slows a side down
            ratios.append(ms["loop"] / ms["stack"])
            rows.append([str(local), str(assignments), f"{ms['loop']:.3f}", f"{ms['stack']:.3f}",
                         f"{ms['loop'] / ms['stack']:.2f}", f"{ms['stacked']:.3f}", f"{ms['loop'] / ms['stacked']:.2f}",
                         "yes" if same else "no"])
    device_note = ("on CPU, F.grouped_mm itself runs one matmul per group, so it saves only the per-expert module "
                   "calls and pays the weight copy" if tokens.device.type == "cpu" else "")
    if min(ratios) >= 1.1:
        verdict = "a grouped GEMM pays at every size measured: replace the loop."
    else:
        verdict = (f"the loop stays: a grouped GEMM would have to be >= 1.10x the loop at every size measured"
                   f"{'; ' + device_note if device_note else ''}.")
    verdict = f"stack + F.grouped_mm is {min(ratios):.2f}-{max(ratios):.2f}x the loop's speed here; {verdict}"
    notes = [
        f"SwiGLU experts h={hidden}, width {ffn} (gate and up fused in fc), fp32 on {torch.device('cpu')}, 1 thread; "
        f"'assignments': the (token, expert) pairs a rank's experts get after dispatch, split over the local experts "
        f"by a uniform random draw. Forward + backward (input and weight gradients), best of "
        f"{args.grouped_rounds} rounds (noise on a shared machine only slows a side down), the sides in ABBA order; "
        f"ratio = loop ms / the side's ms (>1: faster than the loop).",
        "stack+grouped: torch.stack of the per-expert nn.Linear weights in every forward (their gradients split back "
        "in backward) + two F.grouped_mm; stacked grouped: F.grouped_mm on weights stored as one [E, out, in] "
        "parameter per layer (no copy; it would re-key checkpoints and the tp plan). 'same result': output, input "
        "gradient and weight gradients equal to the loop's (atol 1e-5).",
        "Verdict: " + verdict,
    ]
    return format_rows(rows) + "\n" + "\n".join(f"* {note}" for note in notes)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    sections = args.only or SECTIONS
    print(f"torch {torch.__version__}, lightning {L.__version__}, {os.cpu_count()} CPU cores")
    if "ep" in sections:
        print(f"  (1) ep {'/'.join(map(str, EXPERT_PARALLEL_SIZES))} on {RANKS} ranks ...", file=sys.stderr, flush=True)
        print("\n(1) Expert parallelism: tokens/s and per-rank bytes at ep 1/2/4, same model and global batch")
        print(layout_table(args, launch_layouts(args)))
    if "balance" in sections:
        print("  (2) load balance ...", file=sys.stderr, flush=True)
        print("\n(2) Load balance: max/mean expert load per layer, aux_loss_coeff 0 / 1e-2 / 1e-1 / aux-loss-free "
              "expert bias / the families' routers")
        print(balance_table(args))
    if "grouped" in sections:
        print("  (3) loop vs grouped GEMM ...", file=sys.stderr, flush=True)
        print("\n(3) Experts: the MoE layer's loop vs one grouped GEMM (F.grouped_mm), forward + backward")
        print(grouped_table(args))
    if "routers" in sections:
        print("  (4) the families' routers ...", file=sys.stderr, flush=True)
        print("\n(4) Routers: per-expert load of each family's router on the tiny model")
        print(router_table(args))


if __name__ == "__main__":
    main()
