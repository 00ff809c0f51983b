"""``python -m benchmarks.memory planner``: the layout planner against measurement, the papers and published H100
runs, as three tables.

    python -m benchmarks.memory planner                  # all three tables (the activation one measures, ~1 min)
    python -m benchmarks.memory planner --papers         # the papers only (seconds)
    python -m benchmarks.memory planner --as-configured  # published H100 runs at their own layouts (seconds)
    python -m benchmarks.memory planner --activations --json   # the measured activation rows (tests/test_plan.py)

**Activations.** The ``peak`` mode measures each rank's peak of activation bytes on the CPU (tp 1/2, sequence
parallelism, pp 2 under 1F1B, no / selective / full recomputation, GPT- and Llama-shaped, two sizes); the planner
predicts the same rank's ``activation_bytes`` for the same layout, fp32.

**Papers.** The planner predicts step times for published runs, and throughput is reported the way each paper
counts it: Narayanan et al. 2021's ``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` FLOPs per step (which counts the
recomputed forward) divided by the step time and the GPUs. The efficiency constants are calibrated on one run
each (``CALIBRATIONS``: V100 on Shoeybi et al. 2019's single-GPU 1.2B baseline, A100 on Narayanan et al. 2021's
1.7B run without model parallelism, table 1); the checks are other runs:

* Shoeybi et al. 2019 (Megatron-LM): the 8.3B GPT on 512 V100s of 32 DGX-2H (tp 8 x dp 64, batch 512, sequence
  1024) sustains 15.1 PFLOP/s, 76% weak-scaling efficiency against the baseline's 39 TFLOP/s;
* Narayanan et al. 2021, section 5.1: GPT-3 175B on 1024 A100 80GB, batch 1536, sequence 2048, at 140 TFLOP/s
  per GPU (their layout: tp 8 x pp 16, the README's GPT-3 example; interleaved schedule, full recomputation).

**H100 runs, as configured** (``--as-configured``): published runs predicted at their own layouts and settings,
compared in their own units (tokens/s/GPU, or Megatron Bridge's model TFLOP/s/GPU in its own FLOP count). H100's
``matmul_efficiency`` is calibrated on torchtitan's Llama-3.1-8B FSDP run and checked on its 70B run; the
Megatron-Core + Transformer Engine stack's (``h100-te``) on Megatron Bridge's Llama-3-8B FP8 run and checked on its
70B FP8 run. Each
run's facts and their sources are in the comments above its ``PublishedRun`` and in docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from typing import Optional

from benchmarks.harness.tables import MIB, format_rows
from benchmarks.memory.peak import LAYOUTS_BY_KEY, PAD_VOCAB, measure, model_config
from lightning_megatron.models import GPT, GPTConfig
from lightning_megatron.plan import GPUS, Hardware, Layout, Planner, Workload
from lightning_megatron.plan.activations import activation_bytes, receive_buffer_bytes
from lightning_megatron.plan.hardware import GB, TFLOPS
from lightning_megatron.plan.planner import LayoutPlan
from lightning_megatron.plan.shape import ModelShape
from lightning_megatron.parallel.shards import padded_size

ACTIVATION_MARGIN = 0.15  # the stated bound: every prediction within 15% of the measured peak


def megatron_gpt(hidden: int, heads: int, layers: int, seq: int) -> GPTConfig:
    """The papers' GPT: GPT-2 shaped, vocabulary 51,200 (50,257 padded), dropout 0.1 (GPT-2's)."""
    return GPTConfig(vocab_size=51200, max_seq_length=seq, hidden_size=hidden, num_heads=heads, num_layers=layers,
                     dropout=0.1, attention_dropout=0.1)


def paper_flops(config: GPTConfig, batch: int, seq: int) -> float:
    """Narayanan et al. 2021, equation 3: FLOPs of a step, counting full recomputation's extra forward."""
    h, l, v = config.hidden_size, config.num_layers, config.vocab_size
    return 96 * batch * seq * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))


@dataclass(frozen=True)
class PaperRun:
    name: str
    config: GPTConfig
    gpus: int
    batch: int
    seq: int
    precision: str
    gpu: str
    fixed: dict  # the layout as the paper ran it; empty: the planner's search
    reported_tflops: float  # per GPU, in paper_flops' count
    gpus_per_node: Optional[int] = None

    def planner(self, hardware: Optional[Hardware] = None) -> Planner:
        hardware = hardware or GPUS[self.gpu]
        if self.gpus_per_node:
            hardware = replace(hardware, gpus_per_node=self.gpus_per_node)
        workload = Workload(self.batch, self.seq, self.precision, attention="materialized")  # no flash attention then
        return Planner(lambda: GPT(self.config), workload, hardware,
                       world_size=self.gpus, fixed=self.fixed)

    def predicted_tflops(self, hardware: Optional[Hardware] = None) -> tuple[float, Layout]:
        best = self.planner(hardware).plan().best
        if best is None:
            raise RuntimeError(f"{self.name}: no layout fits")
        return paper_flops(self.config, self.batch, self.seq) / best.step_seconds / self.gpus / 1e12, best.layout


FULL = dict(activation_checkpointing="full", context_parallel_size=1, offload_optimizer=False, zero_stage=0)
# Shoeybi et al. 2019: 1.2B on one V100 (batch 8, activation checkpointing after every layer): 39 TFLOP/s.
V100_BASELINE = PaperRun("Megatron-LM 1.2B, 1 V100", GPTConfig.from_name("gpt-1.2b"), 1, 8, 1024, "16-true", "v100",
                         dict(FULL, tensor_parallel_size=1, pipeline_parallel_size=1, micro_batch_size=8), 39.0)
V100_8_3B = PaperRun("Megatron-LM 8.3B, 512 V100 (tp8 x dp64)", GPTConfig.from_name("gpt-8.3b"), 512, 512, 1024,
                     "16-true", "v100", dict(FULL, tensor_parallel_size=8, pipeline_parallel_size=1,
                                             sequence_parallel=False, micro_batch_size=8), 15.1e3 / 512)
# Narayanan et al. 2021, table 1, first row: 1.7B, t = p = 1, 32 GPUs, batch 512: 137 TFLOP/s (44% of peak).
A100_1_7B = PaperRun("Narayanan 2021 1.7B, 32 A100 (dp32)", megatron_gpt(2304, 24, 24, 2048), 32, 512, 2048,
                     "bf16-true", "a100", dict(FULL, tensor_parallel_size=1, pipeline_parallel_size=1), 137.0)
GPT3 = GPTConfig.from_name("gpt3-175b")
GPT3_PAPER = PaperRun("GPT-3 175B, 1024 A100, the paper's layout", GPT3, 1024, 1536, 2048, "bf16-true", "a100",
                      dict(FULL, tensor_parallel_size=8, pipeline_parallel_size=16, sequence_parallel=False,
                           micro_batch_size=1), 140.0)
# The planner's own choice among what that run could use: the 96 B s l h^2 count assumes full recomputation;
# sequence parallelism and context parallelism came later (Korthikanti et al. 2022).
# The distributed optimizer (ZeRO-1) came later too: zero_stage 0.
PAPER_FEATURES = dict(activation_checkpointing="full", sequence_parallel=False, context_parallel_size=1, zero_stage=0,
                      offload_optimizer=False)
GPT3_SEARCH = PaperRun("GPT-3 175B, 1024 A100, the planner's best, tp = 8", GPT3, 1024, 1536, 2048, "bf16-true",
                       "a100", dict(PAPER_FEATURES, tensor_parallel_size=8), 140.0)  # the paper's rule: tp = a node
GPT3_ANY_TP = replace(GPT3_SEARCH, name="GPT-3 175B, 1024 A100, the planner's best, any tp", fixed=PAPER_FEATURES)
# Narayanan et al. 2021, table 2: GPT-3 175B at batch 1536 on 384, 768 and 1536 A100s with PTD-P (t = 8, p = 12,
# micro-batch 1). (Its ZeRO-3 rows measure DeepSpeed's 2021 ZeRO-3, not FSDP2's: not modelled.)
TABLE_2 = [replace(GPT3_PAPER, name=f"GPT-3 175B, {gpus} A100, PTD-P t8 x p12 (table 2)", gpus=gpus,
                   reported_tflops=rate, fixed=dict(FULL, tensor_parallel_size=8, pipeline_parallel_size=12,
                                                    sequence_parallel=False, micro_batch_size=1))
           for gpus, rate in ((384, 153.0), (768, 149.0), (1536, 141.0))]
#: The run each GPU's matmul_efficiency is calibrated on (hardware.py's constants are these, rounded).
CALIBRATIONS = {"v100": V100_BASELINE, "a100": A100_1_7B}


def calibrate(run) -> float:
    """The matmul_efficiency at which the planner predicts ``run``'s reported throughput (bisection): a ``PaperRun``
    on its GPU preset, or a ``PublishedRun`` on its hardware (with ``fp8_efficiency`` moving along, as the H100
    preset assumes)."""
    low, high = 0.05, 1.0
    for _ in range(20):  # to 1e-6 of the efficiency
        middle = (low + high) / 2
        if isinstance(run, PaperRun):
            rate, _ = run.predicted_tflops(replace(GPUS[run.gpu], matmul_efficiency=middle))
            reported = run.reported_tflops
        else:
            rate, _ = run.predict(replace(run.hardware, matmul_efficiency=middle, fp8_efficiency=middle))
            reported = run.reported
        low, high = (middle, high) if rate < reported else (low, middle)
    return (low + high) / 2


# ---------------------------------------------------------------------------------------------------- H100 runs
#: torchtitan's end-of-2024 benchmark (benchmarks/llama3_h100_202412_torchtitan.md, pytorch/torchtitan@820504e; the
#: runs: torchtitan 9dec370, torch 1963fc8): Grand Teton hosts, 8 H100s a host over NVLink, 400 Gb/s RDMA a GPU, H100s
#: with 96 GB of HBM2e at 2.4 TB/s under a 500 W power limit, whose peak is "between SXM and NVL" (their footnote 2:
#: 835 to 989 TFLOP/s bf16 dense). We take the middle, 912 (an assumption: the calibration's efficiency is relative
#: to it, and the 700 W SXM preset takes the same fraction of its 989).
GRAND_TETON_H100 = replace(GPUS["h100"], name="h100-96gb-500w", memory_bytes=96 * GB, memory_bandwidth=2400 * GB,
                           peak_flops=912 * TFLOPS, peak_fp8_flops=2 * 912 * TFLOPS)


def torchtitan_op_sac_share(config: GPTConfig) -> float:
    """The share of a Llama block's forward linear FLOPs that torchtitan's op-level selective checkpointing recomputes:
    its policy saves every ``mm`` output but every second one (parallelize_llama.py's ``_custom_policy`` at 9dec370),
    and the block's matmuls run ``wq, wk, wv, wo, w1, w3, w2``: ``wk``, ``wo`` and ``w3`` are recomputed."""
    q, kv, f = config.num_heads * config.head_dim, config.query_groups * config.head_dim, config.ffn_size
    return (kv + q + f) / (q + 2 * kv + q + 3 * f)


def megatron_bridge_flops(config: GPTConfig, batch: int, seq: int, padded_vocab: int) -> float:
    """A step's model FLOPs as Megatron Bridge counts a Llama (``flop_utils.transformer_flops``, NVIDIA-NeMo/
    Megatron-Bridge@eaddead, the formula of its 26.04 release): per token ``6 h (3 f) L`` (SwiGLU MLP),
    ``6 L (h (q + 2 kv) + q h)`` (projections), ``6 L q s / 2 * 2`` (``Q K^T`` and ``P V`` over the causal half)
    and ``6 h V`` (logits, the padded vocabulary). ``models.flops`` counts the whole ``s x s`` scores instead."""
    h, layers = config.hidden_size, config.num_layers
    q, kv = config.num_heads * config.head_dim, config.query_groups * config.head_dim
    per_token = (6 * h * 3 * config.ffn_size * layers + 6 * layers * (h * (q + 2 * kv) + q * h)
                 + 6 * layers * q * seq + 6 * h * padded_vocab)
    return batch * seq * per_token


_PLANNERS: dict[str, Planner] = {}


@dataclass(frozen=True)
class PublishedRun:
    """A published H100 run at its own layout (``layout``: the strategy's argument names) and settings
    (``workload``), and what it reported in its own unit (``metric``: ``"tokens"`` per second per GPU, or
    ``"mb_tflops"``, Megatron Bridge's model TFLOP/s per GPU)."""

    name: str
    config: GPTConfig
    gpus: int
    workload: Workload
    layout: dict
    hardware: Hardware
    reported: float
    metric: str

    def predict(self, hardware: Optional[Hardware] = None) -> tuple[float, LayoutPlan]:
        planner = _PLANNERS.get(self.name)
        if planner is None:  # one per run: its model states are counted once, whatever the hardware
            planner = _PLANNERS[self.name] = Planner(lambda: GPT(self.config), self.workload, self.hardware,
                                                     world_size=self.gpus)
        planner.hardware = hardware or self.hardware
        plan = planner.evaluate(planner.with_layout(**self.layout))
        if self.metric == "tokens":
            return plan.tokens_per_second / self.gpus, plan
        padded = padded_size(self.config.vocab_size, self.layout.get("tensor_parallel_size", 1), 128)
        flops = megatron_bridge_flops(self.config, self.workload.global_batch_size, self.workload.seq_length, padded)
        return flops / plan.step_seconds / self.gpus / 1e12, plan


LLAMA_8B, LLAMA_70B = GPTConfig.from_name("llama-3.1-8b"), GPTConfig.from_name("llama-3.1-70b")
#: torchtitan table 1, row "FSDP" (the calibration): Llama 3.1 8B, 8 GPUs, local batch 2, global 16, selective (op)
#: checkpointing, eager, bf16 (FSDP2: fp32 shards, bf16 gathers, fp32 reduce-scatters), seq_len 8192
#: (train_configs/llama3_8b.toml at 9dec370).
TORCHTITAN_8B = PublishedRun(
    "torchtitan Llama-3.1-8B, 8 H100, FSDP, op-SAC, bf16, eager", LLAMA_8B, 8,
    Workload(16, 8192, "bf16-true", recomputed_gemm_share=torchtitan_op_sac_share(LLAMA_8B)),
    dict(zero_stage=3, micro_batch_size=2, accumulate_grad_batches=1), GRAND_TETON_H100, 5762.0, "tokens")
#: torchtitan table 4, row "2D": Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8 (sequence parallel), local batch 16 in one
#: forward, global 512, full checkpointing, torch.compile and Float8 (torchao's dynamic tensorwise scaling, every
#: linear but the output layer), seq_len 8192 (train_configs/llama3_70b.toml).
TORCHTITAN_70B = PublishedRun(
    "torchtitan Llama-3.1-70B, 256 H100, FSDP32 x tp8, fp8, compile", LLAMA_70B, 256,
    Workload(512, 8192, "bf16-true", fp8=True),
    dict(tensor_parallel_size=8, sequence_parallel=True, zero_stage=3, micro_batch_size=16, accumulate_grad_batches=1,
         activation_checkpointing="full"), GRAND_TETON_H100, 829.0, "tokens")
#: Megatron Bridge performance summary, 26.04.01 container, LLAMA3_70B pre-training, DGX-H100 row: 64 GPUs, FP8,
#: GBS 256, MBS 1, sequence 8192, DDP (FSDP 0), TP 4, PP 8, CP 1, VP 5: 1664 tokens/s/GPU and 731 model
#: TFLOP/s/GPU (docs/performance-summary-archive.md at 4ab94df; the two disagree by 2% in its FLOP count, the 26.04
#: row, 1633 and 734, agrees: we compare TFLOP/s, the issue's number). The recipe
#: (perf_recipes/llama/h100/llama3.py ``llama3_70b_pretrain_64gpu_h100_fp8cs_config`` at 56ae11d): FP8 current
#: scaling (tensorwise) in every layer, sequence parallel, no recomputation (none set there or in
#: recipes/common.py's pretraining defaults, which turn the distributed optimizer on), its parameter gather
#: overlapped, tp communication overlapped with the GEMMs (userbuffers), pipeline layout
#: "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL" (40 virtual stages: 2 layers each but one of 3 and the last, with the loss, of 1).
#: Megatron Bridge performance summary, 25.11 container, DGX-H100: LLAMA3_8B, 8 GPUs, FP8-CS, GBS 128, MBS 1,
#: sequence 8192, TP 1, PP 1, CP 1, GA 16: 14451 tokens/s/GPU and 744 model TFLOP/s/GPU (docs/performance-summary.md
#: at tag v0.2.1; the h100-te calibration: another model and layout than the 70B row it checks). The recipe at that
#: tag (scripts/performance/configs/llama/llama3_workload_base_configs.py ``LLAMA3_8B_H100_FP8_CS_BASE_CONFIG``, its
#: pretraining defaults in recipes/llama/llama3.py): DDP with the distributed optimizer, its gradient reduce and
#: parameter gather overlapped, full recomputation of 5 of the 32 layers (``recompute_method="block"``: 5/32 of the
#: forward again), FP8 current scaling. The summary's FSDP column says FSDP for this row, the recipe does not (it
#: dropped Megatron FSDP for the recomputation on 2025-11-21, before the release): we follow the recipe; under
#: FSDP (ZeRO-3, no recomputation) the calibration would read 0.692 and the 70B row 0.952.
MEGATRON_BRIDGE_8B = PublishedRun(
    "Megatron Bridge Llama-3-8B, 8 H100, DDP, fp8", LLAMA_8B, 8,
    Workload(128, 8192, "bf16-true", fp8=True, recomputed_gemm_share=5 / 32),
    dict(zero_stage=1, overlap_param_gather=True, micro_batch_size=1, accumulate_grad_batches=16), GPUS["h100-te"],
    744.0, "mb_tflops")
MEGATRON_BRIDGE_LAYERS = (2,) * 35 + (3,) + (2,) * 3 + (1,)
MEGATRON_BRIDGE_70B = PublishedRun(
    "Megatron Bridge Llama-3-70B, 64 H100, tp4 pp8v5, fp8", LLAMA_70B, 64,
    Workload(256, 8192, "bf16-true", fp8=True, overlap_tensor_parallel=True),
    dict(tensor_parallel_size=4, pipeline_parallel_size=8, virtual_pipeline_size=5, sequence_parallel=True,
         pipeline_schedule="interleaved_1f1b", pipeline_layers_per_stage=MEGATRON_BRIDGE_LAYERS, zero_stage=1,
         overlap_param_gather=True, micro_batch_size=1), GPUS["h100-te"], 731.0, "mb_tflops")
H100_RUNS = (TORCHTITAN_8B, TORCHTITAN_70B, MEGATRON_BRIDGE_8B, MEGATRON_BRIDGE_70B)
CALIBRATIONS["h100"], CALIBRATIONS["h100-te"] = TORCHTITAN_8B, MEGATRON_BRIDGE_8B
H100_MARGIN = 0.15  # the stated bound: a published H100 run within 15%
#: Runs the planner is known to miss by more, and why (docs/planner.md, "Limits"): it predicts them below what they
#: reported, and the check says so rather than hiding them.
KNOWN_GAPS = {MEGATRON_BRIDGE_70B.name: "on the Megatron-Core/TE calibration (h100-te) it is predicted 15.1% low, at "
                                        "the bound's edge; 13% of its predicted step is tp and pipeline "
                                        "communication, which the calibration run (tp1 pp1) does not exercise"}


def as_configured_rows() -> list[dict]:
    """Each published H100 run predicted at its own layout: predicted, reported, their ratio, where the time goes."""
    rows = []
    for run in H100_RUNS:
        value, plan = run.predict()
        rows.append({"run": run.name, "layout": plan.layout.label(), "predicted": value, "reported": run.reported,
                     "unit": {"tokens": "tokens/s/GPU", "mb_tflops": "TFLOP/s/GPU (MB's count)"}[run.metric],
                     "ratio": value / run.reported, "mfu": plan.mfu, "calibration": run in CALIBRATIONS.values(),
                     "known_gap": KNOWN_GAPS.get(run.name),
                     "parts": {k: v / plan.step_seconds for k, v in plan.time.parts().items() if v}})
    return rows


def paper_rows() -> list[dict]:
    rows = []
    for run in (V100_BASELINE, V100_8_3B, A100_1_7B, GPT3_PAPER, GPT3_SEARCH, GPT3_ANY_TP, *TABLE_2):
        rate, layout = run.predicted_tflops()
        rows.append({"run": run.name, "layout": layout.label(), "predicted_tflops": rate,
                     "reported_tflops": run.reported_tflops, "ratio": rate / run.reported_tflops,
                     "calibration": run is CALIBRATIONS.get(run.gpu)})
    baseline = rows[0]["predicted_tflops"]
    rows[1]["weak_scaling_efficiency"] = rows[1]["predicted_tflops"] / baseline  # against one V100's prediction
    return rows


def activation_rows(measured: list[dict]) -> list[dict]:
    """The planner's ``activation_bytes`` next to each measured (layout, pipeline rank) of the ``peak`` mode."""
    rows, seen = [], set()
    for row in measured:
        key = (row["layout"], row["pipeline_rank"])
        if key in seen:
            continue
        seen.add(key)
        spec = LAYOUTS_BY_KEY[row["layout"]]
        pipelined = spec.pipeline_parallel_size > 1
        layout = Layout(tensor_parallel_size=spec.tensor_parallel_size, pipeline_parallel_size=spec.pipeline_parallel_size,
                        virtual_pipeline_size=spec.virtual_pipeline_size, pipeline_schedule=spec.pipeline_schedule,
                        data_parallel_size=spec.data_parallel_size, sequence_parallel=spec.sequence_parallel,
                        activation_checkpointing=spec.activation_checkpointing, micro_batch_size=spec.micro_batch_size,
                        accumulate_grad_batches=1 if pipelined else spec.micro_batches)
        workload = Workload(spec.micro_batch_size * spec.micro_batches * spec.data_parallel_size, spec.seq_length,
                            "32-true", pad_vocab_to_multiple_of=PAD_VOCAB)
        shape = ModelShape.of(GPT(model_config(spec)))
        # The measurement counts what a step allocates; torch's receive buffers exist from the first step on.
        predicted = activation_bytes(shape, layout, workload, pipeline_rank=row["pipeline_rank"]) \
            - int(receive_buffer_bytes(shape, layout, workload, row["pipeline_rank"]))
        rows.append({"layout": row["layout"], "pipeline_rank": row["pipeline_rank"], "measured": row["peak_bytes"],
                     "predicted": predicted, "deviation": predicted / row["peak_bytes"] - 1})
    return rows


def print_activation_rows(rows: list[dict]) -> None:
    print(format_rows([["layout", "pp rank", "measured MiB", "predicted MiB", "deviation"],
                       *[[r["layout"], str(r["pipeline_rank"]), f"{r['measured'] / MIB:.3f}",
                          f"{r['predicted'] / MIB:.3f}", f"{r['deviation']:+.1%}"] for r in rows]]))
    worst = max(abs(r["deviation"]) for r in rows)
    print(f"worst deviation {worst:.1%} (stated bound {ACTIVATION_MARGIN:.0%})")


def print_as_configured(rows: list[dict]) -> None:
    print(format_rows([["run", "its layout", "predicted", "published", "unit", "ratio", "where the time goes"],
                       *[[r["run"] + (" (calibration)" if r["calibration"] else ""), r["layout"],
                          f"{r['predicted']:,.0f}", f"{r['reported']:,.0f}", r["unit"], f"{r['ratio']:.3f}",
                          ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["parts"].items(), key=lambda kv: -kv[1])[:3])]
                         for r in rows]], left=(0, 1, 4, 6)))
    for gpu in ("h100", "h100-te"):
        print(f"{gpu}: matmul_efficiency {GPUS[gpu].matmul_efficiency} (calibrated on {CALIBRATIONS[gpu].name}: "
              f"{calibrate(CALIBRATIONS[gpu]):.3f}; stated bound {H100_MARGIN:.0%})")


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--papers", action="store_true", help="only the paper checks (no measurement)")
    parser.add_argument("--as-configured", action="store_true",
                        help="only the published H100 runs, each at its own layout and settings")
    parser.add_argument("--activations", action="store_true",
                        help="only the planner's activation peaks against the measured ones (measures, ~1 min)")
    parser.add_argument("--json", action="store_true",
                        help="print the paper and H100 checks (with --activations: the activation rows) as JSON")
    args = parser.parse_args(argv)
    if args.activations:
        rows = activation_rows(measure())
        if args.json:
            print(json.dumps(rows))
        else:
            print_activation_rows(rows)
        return
    if args.json:
        print(json.dumps({"papers": paper_rows(), "as_configured": as_configured_rows(),
                          "calibrated": {gpu: calibrate(run) for gpu, run in CALIBRATIONS.items()}}))
        return
    if args.as_configured:
        print_as_configured(as_configured_rows())
        return
    if not args.papers:
        print_activation_rows(activation_rows(measure()))
        print()
    rows = paper_rows()
    print(format_rows([["run", "planner's layout", "predicted TFLOP/s/GPU", "reported", "ratio"],
                       *[[r["run"] + (" (calibration)" if r["calibration"] else ""), r["layout"],
                          f"{r['predicted_tflops']:.1f}", f"{r['reported_tflops']:.1f}", f"{r['ratio']:.3f}"]
                         for r in rows]], left=(0, 1)))
    print(f"predicted weak-scaling efficiency of the 8.3B run: {rows[1]['weak_scaling_efficiency']:.1%} (reported 76%)")
    for gpu, run in CALIBRATIONS.items():
        if isinstance(run, PaperRun):
            print(f"{gpu}: matmul_efficiency {GPUS[gpu].matmul_efficiency} (calibrated on {run.name}: "
                  f"{calibrate(run):.3f})")
    if not args.papers:
        print()
        print_as_configured(as_configured_rows())

