"""``python -m benchmarks.memory formulas``: the per-layout proof table: FLOPs, bytes sent and activation bytes per
rank of one training step, each measured and divided by its formula (issue 28's "what must show").

One ``torch.distributed.run`` launch of four CPU processes (gloo) builds a tiny Llama-shaped GPT (an MoE one for
expert parallelism) under each layout the way ``Megatron3DStrategy`` builds it (``parallelize``,
``apply_recompute``, ``prepare_experts``, ``prepare_context_parallel``, ``split_pipeline``, ``shard_zero3`` or
``initialize_parameters``, the pipeline schedule, ``build_step_gradients``), trains one step to warm up (optimizer
state, the pipeline's shapes), then measures the next one: forward, backward, the gradient reduction, the norm
check and clip, the optimizer step and ZeRO's gathers. Three measurements, each independent of its formula:

1. **FLOPs** (``torch.utils.flop_counter.FlopCounterMode`` over the step, with CPU flash attention's kernels
   counted as torch counts SDPA's) against ``plan.flops.rank_step_flops``: Narayanan et al. 2021's model FLOPs
   (``models.flops``) shared out over the ranks doing the work, plus the recomputed forward.
2. **Bytes sent**, by group and collective (``SentBytes``: a ``TorchDispatchMode`` that sees every ``c10d`` op,
   from ``torch.distributed``, FSDP2 and the pipeline schedule alike, each op's bytes on the wire of a ring
   algorithm) against ``plan.communication.step_traffic``, the planner's own formula.
3. **Activations** saved for backward inside the transformer layers (``plan.probes.SavedInLayers``, storages once,
   parameters left out, the backward's recomputation left out) against ``plan.activations.layer_saved_bytes``
   (the planner's term-by-term model of this package's layers) and Korthikanti et al. 2022's GPT-2 formula.

Example::

    python -m benchmarks.memory formulas            # every layout (about a minute on 2 cores)
    python -m benchmarks.memory formulas --smoke    # a subset, for tests/test_benchmarks.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode


from benchmarks.harness.launch import REPO_ROOT, add_worker_flags, read_ranks, run_checked, torchrun
from benchmarks.harness.tables import format_rows
from benchmarks.memory import ENTRY
from lightning_megatron.plan.probes import SavedInLayers

WORKERS = REPO_ROOT / "tests" / "workers"
RANKS = 4
SEED = 1234
HIDDEN, LAYERS, HEADS, GROUPS, FFN, VOCAB, SEQ, GLOBAL_BATCH = 64, 4, 4, 2, 128, 256, 64, 8
BUCKET_MB = 1.0


# ---------------------------------------------------------------------------- the layouts
@dataclass(frozen=True)
class Row:
    """One layout of the table over the four ranks, data parallelism filling what the others leave."""

    key: str
    tp: int = 1
    sp: bool = False
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    cp_attention: str = "ring"
    ep: int = 1
    zero: int = 0
    recompute: str = "none"
    micro_batches: int = 1

    @property
    def dp(self) -> int:
        return RANKS // (self.tp * self.pp * self.cp)

    gpt2: bool = False  # GPT-2-shaped: LayerNorm, GELU, biases, learned positions, tied head

    @property
    def model(self) -> str:
        return "moe" if self.ep > 1 else "gpt2" if self.gpt2 else "llama"


ROWS = (
    Row("dp4"),
    Row("dp4-z1", zero=1),
    Row("dp4-z2", zero=2),
    Row("dp4-z3", zero=3),
    Row("tp2", tp=2),
    Row("tp2-sel", tp=2, recompute="selective"),
    Row("tp2-full", tp=2, recompute="full"),
    Row("tp2-sp", tp=2, sp=True),
    Row("tp2-sp-sel", tp=2, sp=True, recompute="selective"),
    Row("tp2-sp-full", tp=2, sp=True, recompute="full"),
    Row("pp2", pp=2, micro_batches=4),
    Row("pp2-v2", pp=2, vpp=2, micro_batches=4),
    Row("cp2", cp=2),
    Row("cp2-ag", cp=2, cp_attention="all_gather"),
    Row("ep2", ep=2),
    Row("gpt2-tp2-sp", tp=2, sp=True, gpt2=True),
    Row("gpt2-dp4-z1", zero=1, gpt2=True),
)
ROWS_BY_KEY = {row.key: row for row in ROWS}
SMOKE = ("dp4-z3", "tp2-full", "pp2-v2", "cp2", "ep2", "gpt2-dp4-z1")


def model_config(model: str):
    """``llama``: Llama-shaped (RMSNorm, rotary, SwiGLU, grouped-query, untied head); ``moe``: the same with 4
    experts top-2 in every layer; ``gpt2``: GPT-2-shaped (LayerNorm, GELU, biases, learned positions, tied head)."""
    from lightning_megatron.models.gpt import GPTConfig
    from lightning_megatron.models.moe import MoEConfig

    sizes = dict(vocab_size=VOCAB, max_seq_length=SEQ, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                 dropout=0.0, attention_dropout=0.0)
    if model == "gpt2":
        return GPTConfig(**sizes)
    return GPTConfig.from_name("llama-tiny", **sizes, num_query_groups=GROUPS, ffn_hidden_size=FFN,
                               moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=FFN // 2) if model == "moe" else None)


# ---------------------------------------------------------------------------- measuring
def _process_group(value):
    """The ``ProcessGroup`` a ``c10d`` op was given (a ``ScriptObject``), else None."""
    import torch.distributed as dist

    if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(value._type()):
        return dist.ProcessGroup.unbox(value)
    return None


def _tensors(args) -> list[Tensor]:
    found = []
    for value in args:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += _tensors(value)
    return found


def _nbytes(tensors) -> int:
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


class SentBytes(TorchDispatchMode):
    """The bytes this rank puts on the wire, by ``"<group>/<collective>"``, for every ``c10d`` op issued while active
    (from ``torch.distributed``'s functions, FSDP2's and the pipeline schedule's alike: they all dispatch these ops).
    A ring algorithm's bytes (``plan.communication.ring_sent``): all-reduce ``2 (n - 1) / n`` of the tensor,
    all-gather and reduce-scatter ``(n - 1) / n`` of the full one, a send its tensor, an all-to-all what leaves for
    the other ranks (its split sizes), a receive nothing. ``names``: ``{name: group}``; an unnamed group is
    ``other``. Scalars (at most 2 elements) and broadcasts (the pipeline's loss totals) go to ``control``."""

    def __init__(self, names: dict) -> None:
        super().__init__()
        self.names = {id(group): name for name, group in names.items() if group is not None}
        self.sent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self._count(func._opname, args)
        return func(*args, **(kwargs or {}))

    def _count(self, op: str, args) -> None:
        from lightning_megatron.plan.communication import ring_sent

        group = next((g for g in map(_process_group, args) if g is not None), None)
        if op in ("barrier", "monitored_barrier_", "recv_", "recv_any_source_"):
            return
        n = group.size()
        name = self.names.get(id(group), "other")
        if op == "send":
            kind, sent = "send", _nbytes(args[0])
        elif op == "allreduce_":
            kind, sent = "all_reduce", ring_sent("all_reduce", n, _nbytes(args[0]))
        elif op == "_allgather_base_":
            kind, sent = "all_gather", ring_sent("all_gather", n, _nbytes(args[0]))
        elif op == "allgather_":  # [[outputs per rank]], [input]
            kind, sent = "all_gather", ring_sent("all_gather", n, n * _nbytes(args[1]))
        elif op == "_reduce_scatter_base_":
            kind, sent = "reduce_scatter", ring_sent("reduce_scatter", n, _nbytes(args[1]))
        elif op == "alltoall_base_":  # output, input, group, output splits, input splits
            out, x, _, _, splits = args[:5]
            row = x.numel() // max(1, x.shape[0]) * x.element_size()
            mine = splits[group.rank()] if splits else x.shape[0] // n
            kind, sent = "all_to_all", (x.shape[0] - mine) * row
        elif op == "broadcast_":
            kind, sent = "broadcast", ring_sent("all_gather", n, _nbytes(args[0]))
        else:
            raise RuntimeError(f"SentBytes does not know the c10d op {op!r}; add its bytes on the wire.")
        largest = max((t.numel() for t in _tensors(args)), default=0)
        if kind == "broadcast" or largest <= 2:  # the loss totals, token counts, the norm: a few bytes
            name, kind = "control", kind
        self.sent[f"{name}/{kind}"] += sent
        self.calls[f"{name}/{kind}"] += 1


def _cpu_flash_flops():
    """FlopCounterMode counts SDPA's CUDA kernels; CPU's flash kernel (``blocks.py``, and SDPA on CPU) by the same
    formulas: the whole ``s_q x s_k`` block, forward ``4 s_q s_k d`` per head, backward twice that."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):  # shapes (FlopCounterMode's shape_wrapper)
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, query, key, value)

    from lightning_megatron.models.experts import grouped_gemm_flops

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
            aten._grouped_mm: grouped_gemm_flops}  # MoE experts: torch has no formula for grouped GEMMs


# ---------------------------------------------------------------------------- building and stepping
@dataclass
class Built:
    state: object
    module: nn.Module
    optimizer: object
    step: object
    runner: object
    splitter: object
    zero3: object
    layers: list


def build(row: Row) -> Built:
    from lightning_megatron.expert_parallel.apply import prepare_experts
    from lightning_megatron.models import GPT
    from lightning_megatron.optim.nonfinite import NonFiniteCheck
    from lightning_megatron.optim.step import build_step_gradients
    from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
    from lightning_megatron.parallel.initialize import initialize_parameters
    from lightning_megatron.strategy.options import StrategyOptions
    from lightning_megatron.strategy.preparation import apply_recompute, prepare_context_parallel, shard_zero3, split_pipeline
    from lightning_megatron.tensor_parallel import parallelize

    config = ParallelConfig(tensor_parallel_size=row.tp, pipeline_parallel_size=row.pp, data_parallel_size=row.dp,
                            sequence_parallel=row.sp, virtual_pipeline_size=row.vpp, context_parallel_size=row.cp,
                            expert_parallel_size=row.ep, zero_stage=row.zero)
    state = ParallelState.create(config, "cpu")
    torch.manual_seed(SEED)
    module = GPT(model_config(row.model))
    with torch.device("meta"):
        module.configure_model()
    rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, "cpu")
    parallelize(module, module.tensor_parallel_plan(), state, rng=rng, pad_vocab_to_multiple_of=1)
    apply_recompute(module, row.recompute, rng)
    prepare_experts(module, state)
    splitter = prepare_context_parallel(module, state, row.cp_attention)
    schedule = "interleaved_1f1b" if row.vpp > 1 else "1f1b"
    split = split_pipeline(module, state, schedule)
    zero3 = None
    if row.zero == 3:
        zero3 = shard_zero3(module, state, precision="32-true", seed=SEED, device="cpu")
    else:
        initialize_parameters(module, SEED, device="cpu", only_meta=True)
    module.train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    step = build_step_gradients(module, state, [optimizer], StrategyOptions(zero_stage=state.config.zero_stage,
                                bucket_size_mb=BUCKET_MB), zero3=zero3, loss_scaler=None,
                                nonfinite=NonFiniteCheck("error", 10), device=torch.device("cpu"))
    runner = None
    if split is not None:
        if str(WORKERS) not in sys.path:
            sys.path.insert(0, str(WORKERS))
        from layout_runs import start_worker_pipeline

        per_rank = GLOBAL_BATCH // row.dp
        runner = start_worker_pipeline(split, state, step, per_rank // row.micro_batches, schedule)
    blocks = module.pipeline_blocks()
    container = blocks.root_of(module).get_submodule(blocks.layers)
    layers = [layer for layer in container.children()]
    return Built(state, module, optimizer, step, runner, splitter, zero3, layers)


def rank_batch(row: Row, built: Built) -> dict:
    """This rank's rows of the global batch (random tokens, fixed seed), then its context-parallel chunks."""
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    per_rank = GLOBAL_BATCH // row.dp
    mine = tokens[built.state.data_parallel_rank * per_rank:(built.state.data_parallel_rank + 1) * per_rank]
    batch = {"input_ids": mine[:, :-1].contiguous(), "labels": mine[:, 1:].contiguous()}
    return batch if built.splitter is None else built.splitter(batch)


def train_step(row: Row, built: Built, batch: dict) -> None:
    """One optimizer step as the strategy runs it: token-summed losses times the backward scale, the gradient
    reduction (``finish``), the non-finite check whose norm the clip reuses, AdamW, ZeRO's parameter gathers."""
    step, root = built.step, built.module.model
    side = {key: value for key, value in batch.items() if key not in ("input_ids", "labels")}
    if built.runner is not None:  # the schedule runs every micro-batch's forward and backward
        _, tokens = root.loss(batch["input_ids"], batch["labels"], **side)
    else:  # one micro-batch
        step.sync.start_micro_batch(sync=True)
        loss_sum, tokens = root.loss(batch["input_ids"], batch["labels"], **side)
        (loss_sum * step.backward_scale(tokens, accumulation=1, loss_scale=1.0)).backward()
    step.add_tokens(tokens)
    step.finish(accumulation=1, loss_scale=1.0)
    norm, _ = step.check_finite(built.optimizer.param_groups, step=0, epoch=0)
    if built.zero3 is not None:
        built.zero3.clip_grad_norm_(1.0, norm=norm)
    else:
        step.clip(built.optimizer.param_groups, 1.0, norm=norm)
    built.optimizer.step()
    step.after_step()


class RoutedAway:
    """The share of this rank's routed token copies that go to another expert-parallel rank's experts, read from
    what the router hands each dispatch (``tokens_per_expert``): the all-to-all formula's input under real routing."""

    def __init__(self) -> None:
        self.away = self.total = 0

    def __enter__(self) -> "RoutedAway":
        from lightning_megatron.expert_parallel.dispatcher import AllToAllDispatcher

        self.original = original = AllToAllDispatcher.dispatch
        counter = self

        def dispatch(dispatcher, tokens, tokens_per_expert):
            local = dispatcher.num_local_experts
            mine = tokens_per_expert[dispatcher.rank * local:(dispatcher.rank + 1) * local].sum()
            counter.total += int(tokens_per_expert.sum())
            counter.away += int(tokens_per_expert.sum() - mine)
            return original(dispatcher, tokens, tokens_per_expert)

        AllToAllDispatcher.dispatch = dispatch
        return self

    def __exit__(self, *exc) -> None:
        from lightning_megatron.expert_parallel.dispatcher import AllToAllDispatcher

        AllToAllDispatcher.dispatch = self.original

    @property
    def share(self) -> Optional[float]:
        return self.away / self.total if self.total else None


def group_names(state) -> dict:
    """The layout's groups by the formula's names; where two coincide the later name wins (the replicas over dp x cp
    are ``dp``; an expert's data-parallel replicas ``edp`` where they differ from them)."""
    return {"mp": state.model_parallel_group, "edp": state.expert_data_parallel_group,
            "dp": state.replica_group, "ep": state.expert_parallel_group, "pp": state.pipeline_parallel_group,
            "cp": state.context_parallel_group, "tp": state.tensor_parallel_group}


def measure_row(row: Row) -> dict:
    """Build ``row``, train one step, measure the next on this rank."""
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    built = build(row)
    batch = rank_batch(row, built)
    train_step(row, built, batch)  # warm-up: optimizer state, the schedule's shapes
    flops = FlopCounterMode(display=False, custom_mapping=_cpu_flash_flops())
    with SentBytes(group_names(built.state)) as sent, flops, SavedInLayers(built.module, built.layers) as saved, \
            RoutedAway() as routed:
        train_step(row, built, batch)
    built.step.remove()
    return {"rank": dist.get_rank(), "pipeline_rank": built.state.pipeline_parallel_rank,
            "flops": flops.get_total_flops(), "sent": dict(sent.sent), "calls": dict(sent.calls),
            "saved_layers": saved.bytes["layers"], "saved_outside": saved.bytes["outside"], "routed_away": routed.share}


def worker(result_dir: Path, keys: list[str]) -> None:
    """Every layout in ``keys``, one after another over the same processes; ``rank{r}.json`` per rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {key: measure_row(ROWS_BY_KEY[key]) for key in keys}
    (result_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)


def launch(keys: list[str]) -> list[dict]:
    """One ``torch.distributed.run`` launch of ``RANKS`` processes for every layout in ``keys``."""
    with tempfile.TemporaryDirectory(prefix="formulas-") as tmp:
        cmd = torchrun(RANKS, ENTRY, "formulas", "--worker", "--result-dir", tmp, "--layouts", ",".join(keys))
        run_checked(cmd, "the workers", Path(tmp))
        return read_ranks(Path(tmp), RANKS)


# ---------------------------------------------------------------------------- the formulas
def plan_inputs(row: Row):
    """The planner's view of ``row``: its ``ModelShape``, ``Layout``, ``Workload`` and model states per pipeline
    rank (``Planner.model_state_bytes``: the gradient buffers the dp formula reduces)."""
    from lightning_megatron.models import GPT
    from lightning_megatron.plan import GPUS, Layout, Planner, Workload

    per_rank = GLOBAL_BATCH // row.dp
    workload = Workload(GLOBAL_BATCH, SEQ, "32-true", bucket_size_mb=BUCKET_MB, pad_vocab_to_multiple_of=1)
    layout = Layout(tensor_parallel_size=row.tp, pipeline_parallel_size=row.pp, data_parallel_size=row.dp,
                    sequence_parallel=row.sp, zero_stage=row.zero, virtual_pipeline_size=row.vpp,
                    expert_parallel_size=row.ep, context_parallel_size=row.cp,
                    pipeline_schedule="interleaved_1f1b" if row.vpp > 1 else "1f1b",
                    micro_batch_size=per_rank // row.micro_batches, activation_checkpointing=row.recompute)
    planner = Planner(lambda: GPT(model_config(row.model)), workload, GPUS["a100"], world_size=RANKS)
    states = [planner.model_state_bytes(layout, pipeline_rank=r) for r in range(row.pp)]
    return planner.shape, layout, workload, states


def korthikanti_bytes(shape, layout, w: int) -> float:
    """Korthikanti et al. 2022's bytes per token and layer (16-bit, GPT-2's layer with dropout and materialised
    scores), in ``w``-byte elements: ``h (10 + 24 / t + 5 a s / (h t))``, with SP ``h (34 + 5 a s / h) / t``;
    selective recomputation drops the ``5 a s`` scores' term, full keeps the input (``2 h``, ``/ t`` with SP)."""
    h, a, s, t = shape.hidden_size, shape.num_heads, SEQ // layout.context_parallel_size, layout.tensor_parallel_size
    q = t if layout.sequence_parallel else 1
    mode = layout.activation_checkpointing
    if mode == "full":
        return 2 * h / q * w / 2
    scores = 5 * a * s / (h * t) if mode == "none" else 0.0
    kept = 34 / t if layout.sequence_parallel else 10 + 24 / t
    return h * (kept + scores) * w / 2


def formulas(row: Row, pipeline_rank: int, routed_away: Optional[float]) -> dict:
    """Every formula of ``row`` on a rank of ``pipeline_rank``: FLOPs, bytes sent by group, saved bytes."""
    from lightning_megatron.plan.activations import layer_saved_bytes
    from lightning_megatron.plan.communication import sent_by_group, step_collectives
    from lightning_megatron.plan.flops import pipeline_rank_layers, rank_step_flops

    shape, layout, workload, states = plan_inputs(row)
    flops = rank_step_flops(shape, layout, workload, pipeline_rank=pipeline_rank)
    collectives = step_collectives(shape, layout, workload, states[pipeline_rank], pipeline_rank=pipeline_rank,
                                   context_parallel_attention=row.cp_attention, routed_away=routed_away)
    w = workload.compute_bytes
    token_layers = GLOBAL_BATCH // row.dp * SEQ // row.cp * pipeline_rank_layers(shape, layout, pipeline_rank)
    return {"flops": flops.executed, "model_flops": flops.model + flops.recomputation,
            "sent": sent_by_group(collectives),
            "collectives": [f"{c.group} {c.kind} x{c.calls:g}: {c.what}" for c in collectives],
            "saved": token_layers * layer_saved_bytes(shape, layout, w),
            "korthikanti": token_layers * korthikanti_bytes(shape, layout, w)}


# ---------------------------------------------------------------------------- the table
def table_rows(keys: list[str], ranks: list[dict]) -> list[dict]:
    """Per (layout, pipeline rank): measured over formula, each summed over the ranks of that pipeline rank (expert
    parallelism's routing makes ranks unequal; the sums are what the formulas fix), and the spread of the
    per-rank FLOPs ratios."""
    out = []
    for key in keys:
        row = ROWS_BY_KEY[key]
        for pipeline_rank in range(row.pp):
            mine = [r[key] for r in ranks if r[key]["pipeline_rank"] == pipeline_rank]
            predicted = [formulas(row, pipeline_rank, m["routed_away"]) for m in mine]
            measured_groups: dict[str, float] = defaultdict(float)
            control = 0.0
            for m in mine:
                for name, sent in m["sent"].items():
                    group = name.split("/")[0]
                    if group == "control":
                        control += sent
                    else:
                        measured_groups[group] += sent
            formula_groups: dict[str, float] = defaultdict(float)
            for p in predicted:
                for group, sent in p["sent"].items():
                    formula_groups[group] += sent
            groups = sorted(set(measured_groups) | set(formula_groups), key=lambda g: ("tp", "cp", "pp", "ep", "dp",
                                                                                        "edp", "mp", "other").index(g))
            per_rank_flops = [m["flops"] / p["flops"] for m, p in zip(mine, predicted)]
            total = sum(measured_groups.values()), sum(formula_groups.values())
            out.append({
                "layout": key, "pipeline_rank": pipeline_rank, "ranks": len(mine),
                "flops": sum(m["flops"] for m in mine) / sum(p["flops"] for p in predicted),
                "model_flops": sum(m["flops"] for m in mine) / sum(p["model_flops"] for p in predicted),
                "flops_spread": max(per_rank_flops) - min(per_rank_flops),
                "bytes": total[0] / total[1] if total[1] else (1.0 if not total[0] else float("inf")),
                "bytes_sent": total[0] / len(mine),
                "groups": {g: (measured_groups[g] / formula_groups[g] if formula_groups[g] else float("inf"))
                           for g in groups},
                "control": control / len(mine),
                "activations": sum(m["saved_layers"] for m in mine) / sum(p["saved"] for p in predicted),
                "korthikanti": sum(m["saved_layers"] for m in mine) / sum(p["korthikanti"] for p in predicted),
                "saved_bytes": sum(m["saved_layers"] for m in mine) / len(mine),
                "formula_collectives": predicted[0]["collectives"],
            })
    return out


def format_table(rows: list[dict]) -> str:

    header = ["layout", "pp rank", "FLOPs / formula", "/ model FLOPs", "bytes sent / formula", "by group",
              "sent KiB/rank", "control B", "activations / planner", "/ Korthikanti", "saved KiB/rank"]
    lines = [header]
    for r in rows:
        lines.append([r["layout"], str(r["pipeline_rank"]), f"{r['flops']:.3f}", f"{r['model_flops']:.3f}",
                      f"{r['bytes']:.3f}", " ".join(f"{g} {v:.3f}" for g, v in r["groups"].items()) or "-",
                      f"{r['bytes_sent'] / 1024:.1f}", f"{r['control']:.0f}", f"{r['activations']:.3f}",
                      f"{r['korthikanti']:.3f}", f"{r['saved_bytes'] / 1024:.1f}"])
    return format_rows(lines)


def within_targets(row: dict) -> list[str]:
    """What misses its target (FLOPs and bytes 1.00 +- 2%, activations +- 5%), in words."""
    misses = []
    for name, value, tolerance in (("FLOPs", row["flops"], 0.02), ("bytes", row["bytes"], 0.02),
                                   ("activations", row["activations"], 0.05)):
        if not abs(value - 1) <= tolerance:
            misses.append(f"{row['layout']} (pp rank {row['pipeline_rank']}): {name} ratio {value:.3f}")
    return misses


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_worker_flags(parser)
    parser.add_argument("--layouts", help=f"comma list of layouts (default: all): {', '.join(ROWS_BY_KEY)}")
    parser.add_argument("--smoke", action="store_true", help=f"only {', '.join(SMOKE)}")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = parser.parse_args(argv)
    keys = args.layouts.split(",") if args.layouts else list(SMOKE if args.smoke else ROWS_BY_KEY)
    unknown = [key for key in keys if key not in ROWS_BY_KEY]
    if unknown:
        sys.exit(f"unknown layouts {unknown}; known: {', '.join(ROWS_BY_KEY)}")
    if args.worker:
        worker(args.result_dir, keys)
        return
    rows = table_rows(keys, launch(keys))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(describe())
    print(format_table(rows))
    misses = [miss for row in rows for miss in within_targets(row)]
    print("all within targets" if not misses else "outside the targets: " + "; ".join(misses))


def describe() -> str:
    config = model_config("llama")
    return (f"Llama-shaped GPT h={config.hidden_size} layers={config.num_layers} heads={config.num_heads} "
            f"kv-groups={config.query_groups} SwiGLU ffn={config.ffn_hidden_size} vocab={config.vocab_size}, "
            f"seq {SEQ}, global batch {GLOBAL_BATCH}, fp32, dropout 0 (ep2: 4 experts top-2 of width {FFN // 2}; "
            f"gpt2-: GPT-2-shaped, the same sizes, ffn {4 * HIDDEN}); "
            f"{RANKS} CPU processes (gloo), every layout in one launch; one measured step after a warm-up step; "
            f"torch {torch.__version__}")

