"""Per-GPU model-state bytes (and a rough activation estimate) of the layouts in ``configs/*.yaml``.

    python configs/model_state.py                         # every config
    python configs/model_state.py configs/llama-3.1-70b.yaml --nodes 32

Parameters per rank are not estimated but *counted*: every rank's part of the model is built
the way ``Megatron3DStrategy`` builds it (``configure_model`` on the meta device, then
``parallelize`` with the model's ``tensor_parallel_plan()`` and the strategy's vocabulary
padding, then ``split_pipeline``), inside one process that plays each (pp, tp) rank over
torch's fake process group. So replicated key/value heads, vocabulary padding, replicated
norms and the embedding/head placement are all as in a real run.

Bytes per parameter, as the strategy's ``model_state_bytes`` reports them after the first
step (``optim/main_params.py``, ``optim/grad_sync.py``; AdamW, GPT's optimizer):

=================  ==========  =========  ===================  ===================  ===============
precision          parameters  gradients  fp32 main params     Adam (2 fp32 moms)   ZeRO-1 total
=================  ==========  =========  ===================  ===================  ===============
bf16-true          2           2          4 (/N at ZeRO >= 1)  8 (/N at ZeRO >= 1)  4 + 12/N
bf16-mixed         4           4          0 (views of params)  8 (/N at ZeRO >= 1)  8 + 8/N
32-true            4           4          0                    8                    8 + 8/N
=================  ==========  =========  ===================  ===================  ===============

(N = data-parallel size x context-parallel size, the ranks holding the same weights; ZeRO-2 also divides the
gradients by N.) Bucket padding to a
multiple of N is ignored (under a KiB per bucket). Experts of MoE layers: a rank holds ``1/ep`` of
them (``expert_parallel_size``), and ZeRO shards their state over the ``dp / ep`` ranks holding
the same experts (N = dp / ep for them).

Activations (rough, per GPU, *not* part of the model state): per transformer layer and per
token of a micro-batch, the tensors autograd keeps, in the compute dtype: the two norms'
inputs (``/tp`` under sequence parallelism) and the two all-gathered (or, without sequence
parallelism, replicated) inputs of ``qkv`` and ``fc``; ``q, k, v`` (this rank's ``qkv``
rows); attention's output twice (``scaled_dot_product_attention``'s saved output and
``proj``'s contiguous input; flash / memory-efficient kernels, so no ``s x s`` scores); and
two tensors of this rank's ``fc`` width (SwiGLU: gate, up, silu(gate), their product = 2 x
[gate | up]; GELU: fc's output and the GELU's). Dropout masks, the residual stream's
transients and allocator fragmentation are left out. A pipeline rank holds that for its
layers times the micro-batches in flight (1F1B: ``pp - stage``; interleaved 1F1B: Megatron's
warmup count ``2 (pp - stage - 1) + (vpp - 1) pp + 1`` virtual stages; pp=1: one forward of
the whole per-rank batch); under context parallelism a rank holds ``seq_length / cp`` tokens of each
sequence. The last stage adds the vocab-parallel cross-entropy: this rank's
logits in the compute dtype plus their fp32 copy and the saved fp32 softmax.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_megatron.models.transformer import TransformerLayer
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.pipeline.layout import check_micro_batches, check_schedule
from lightning_megatron.preparation import split_pipeline
from lightning_megatron.tensor_parallel.plan import parallelize
from lightning_megatron.tensor_parallel.sharding import padded_size

CONFIGS = Path(__file__).resolve().parent
GIB = 2**30
SIXTEEN_BIT = ("bf16-true", "16-true")


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    tp: int
    pp: int
    dp: int
    vpp: int
    sequence_parallel: bool
    zero_stage: int
    expert_parallel_size: int
    context_parallel_size: int
    precision: str
    schedule: str
    micro_batch_size: int
    seq_length: int
    global_batch_size: int
    pad_vocab: int
    layers_per_stage: Optional[tuple[int, ...]]
    model_class: str
    model_config: object

    @classmethod
    def from_yaml(cls, path: Path, nodes: Optional[int] = None) -> "Layout":
        text = yaml.safe_load(path.read_text())
        trainer, model, data = text["trainer"], text["model"], text.get("data", {}).get("init_args", {})
        strategy = trainer["strategy"]["init_args"]
        tp, pp = strategy.get("tensor_parallel_size", 1), strategy.get("pipeline_parallel_size", 1)
        world = trainer.get("devices", 1) * (nodes or trainer.get("num_nodes", 1))
        dp = strategy.get("data_parallel_size", "auto")
        cp = strategy.get("context_parallel_size", 1)
        layers = strategy.get("pipeline_layers_per_stage")
        return cls(
            name=path.stem, world=world, tp=tp, pp=pp, dp=world // (tp * pp * cp) if dp == "auto" else dp,
            context_parallel_size=cp,
            vpp=strategy.get("virtual_pipeline_size", 1), sequence_parallel=strategy.get("sequence_parallel", False),
            zero_stage=strategy.get("zero_stage", 0), expert_parallel_size=strategy.get("expert_parallel_size", 1),
            precision=str(trainer.get("precision", "32-true")),
            schedule=strategy.get("pipeline_schedule", "1f1b"), micro_batch_size=strategy.get("micro_batch_size", 1),
            seq_length=data.get("seq_length", 128), global_batch_size=data.get("global_batch_size", 16),
            pad_vocab=strategy.get("pad_vocab_to_multiple_of", 128), layers_per_stage=tuple(layers) if layers else None,
            model_class=model["class_path"], model_config=model.get("init_args", {}).get("config"),
        )


def size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB / 10 else f"{num_bytes / 2**20:.2f} MiB"


def build_module(layout: Layout) -> nn.Module:
    """The LightningModule of the config, built on the meta device as the strategy builds it."""
    module_name, class_name = layout.model_class.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), class_name)
    with torch.device("meta"):
        module = cls(layout.model_config) if layout.model_config is not None else cls()
        module.configure_model()
    return module


@dataclass(frozen=True)
class RankCount:
    pp_rank: int
    parameters: int  # this rank's parameter elements (tied ones once), its experts included
    expert_parameters: int  # of which the experts of MoE layers (1/ep of them)
    layers: int
    activation_elements_per_token: int  # summed over this rank's layers, one micro-batch
    head_logits_per_token: int  # this rank's vocabulary slice (last stage), else 0


def count_rank(layout: Layout, pp_rank: int, tp_rank: int = 0) -> RankCount:
    """Build rank (pp_rank, tp_rank)'s part of the model over a fake process group and count it."""
    world = layout.tp * layout.pp  # dp does not change what a rank holds before ZeRO shards it
    if dist.is_initialized():
        raise RuntimeError("configs/model_state.py plays every rank over torch's fake process group, so it needs a "
                           "process without a default process group; run it as a script (or in a fresh process).")
    dist.init_process_group("fake", store=FakeStore(), rank=pp_rank * layout.tp + tp_rank, world_size=world)
    try:
        config = ParallelConfig(tensor_parallel_size=layout.tp, pipeline_parallel_size=layout.pp, data_parallel_size=1,
                                sequence_parallel=layout.sequence_parallel, virtual_pipeline_size=layout.vpp,
                                pipeline_layers_per_stage=layout.layers_per_stage)
        state = ParallelState.create(config, "cpu")
        module = build_module(layout)
        parallelize(module, module.tensor_parallel_plan(), state, pad_vocab_to_multiple_of=layout.pad_vocab)
        split_pipeline(module, state)
        every_expert = sum(p.numel() for name, p in module.named_parameters() if ".experts." in name)
        experts = every_expert // layout.expert_parallel_size  # experts split evenly (validate() checked it)
        parameters = sum(p.numel() for p in dict.fromkeys(module.parameters())) - every_expert + experts
        layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
        activations = sum(layer_activation_elements(layer, layout) for layer in layers)
        last = pp_rank == layout.pp - 1
        sizes = module.config
        vocab = padded_size(sizes.vocab_size, layout.tp, layout.pad_vocab) // layout.tp if last else 0
        return RankCount(pp_rank, parameters, experts, len(layers), activations, vocab)
    finally:
        dist.destroy_process_group()


def layer_activation_elements(layer: TransformerLayer, layout: Layout) -> int:
    """Elements per token autograd keeps for one layer on this rank (see the module docstring)."""
    hidden = layer.ln_1.weight.shape[0]
    norms = 2 * hidden // layout.tp + 2 * hidden if layout.sequence_parallel else 4 * hidden
    qkv_rows = layer.attn.qkv.weight.shape[0]
    attention_out = layer.attn.proj.weight.shape[1]
    experts = getattr(layer.mlp, "experts", None)
    if experts is None:
        return norms + qkv_rows + 2 * attention_out + 2 * layer.mlp.fc.weight.shape[0]
    # MoE: each token's top_k dispatched copies (the experts' inputs), two fc-wide tensors per copy as a dense MLP
    # keeps (dropless, so on average), and the shared expert's like a dense MLP.
    top_k, fc_rows = layer.mlp.config.top_k, next(iter(experts.values())).fc.weight.shape[0]
    shared = getattr(layer.mlp, "shared_expert", None)
    mlp = top_k * (hidden + 2 * fc_rows) + (2 * shared.fc.weight.shape[0] if shared is not None else 0)
    return norms + qkv_rows + 2 * attention_out + mlp


def in_flight(layout: Layout, pp_rank: int) -> float:
    """Micro-batches (in units of the rank's whole layer set) whose activations a stage holds at its peak."""
    if layout.pp == 1:
        return 1.0
    micro_batches = layout.global_batch_size // layout.dp // layout.micro_batch_size
    if layout.schedule == "gpipe":
        return float(micro_batches)
    if layout.vpp > 1:
        virtual = 2 * (layout.pp - pp_rank - 1) + (layout.vpp - 1) * layout.pp + 1
        return min(virtual, micro_batches * layout.vpp) / layout.vpp
    return float(min(layout.pp - pp_rank, micro_batches))


def bytes_per_parameter(layout: Layout, *, experts: bool = False) -> dict[str, float]:
    """Bytes per local parameter of each model-state category, as ``model_state_bytes`` counts them (``experts``:
    of an MoE layer's experts, whose ZeRO group is the ``dp / ep`` ranks holding the same ones)."""
    n = layout.dp // layout.expert_parallel_size if experts else layout.dp * layout.context_parallel_size  # dp x cp
    sixteen = layout.precision in SIXTEEN_BIT
    param = 2 if sixteen else 4
    main = 4 if sixteen else 0
    if layout.zero_stage == 3:  # FSDP-sharded fp32 params (the main params) + their grads + Adam, all / N
        return {"parameters": 4 / n, "gradients": 4 / n, "main_parameters": 0.0, "optimizer_state": 8 / n}
    shard = n if layout.zero_stage >= 1 else 1
    return {"parameters": param, "gradients": param / (n if layout.zero_stage == 2 else 1),
            "main_parameters": main / shard, "optimizer_state": 8 / shard}


@dataclass(frozen=True)
class Report:
    layout: Layout
    total_parameters: int
    ranks: list[RankCount]

    @property
    def peak_rank(self) -> RankCount:
        return max(self.ranks, key=lambda r: r.parameters)

    def model_state(self, rank: RankCount) -> dict[str, float]:
        dense, experts = bytes_per_parameter(self.layout), bytes_per_parameter(self.layout, experts=True)
        return {name: dense[name] * (rank.parameters - rank.expert_parameters) + experts[name] * rank.expert_parameters
                for name in dense}

    def activations(self, rank: RankCount) -> float:
        layout = self.layout
        compute = 2 if layout.precision.startswith(("bf16", "16")) else 4
        seq = layout.seq_length // layout.context_parallel_size  # a context-parallel rank's share of each sequence
        tokens = seq * (layout.micro_batch_size if layout.pp > 1 else layout.global_batch_size // layout.dp)
        layers = rank.activation_elements_per_token * tokens * compute * in_flight(layout, rank.pp_rank)
        head = rank.head_logits_per_token * tokens * (compute + 8)
        return layers + head

    def describe(self) -> str:
        layout, peak = self.layout, self.peak_rank
        state = self.model_state(peak)
        per = bytes_per_parameter(layout)
        worst = max(self.ranks, key=lambda r: sum(self.model_state(r).values()) + self.activations(r))
        lines = [
            f"{layout.name}: {self.total_parameters:,} parameters; {layout.world} GPUs = tp {layout.tp} x pp {layout.pp}"
            f"{f' (vpp {layout.vpp})' if layout.vpp > 1 else ''}"
            f"{f' x cp {layout.context_parallel_size}' if layout.context_parallel_size > 1 else ''} x dp {layout.dp}"
            f"{f' (ep {layout.expert_parallel_size})' if layout.expert_parallel_size > 1 else ''}, {layout.precision}, "
            f"zero_stage {layout.zero_stage}, sequence_parallel {layout.sequence_parallel}",
            f"  largest rank (pp stage {peak.pp_rank}): {peak.parameters:,} parameters"
            f"{f' ({peak.expert_parameters:,} of them experts)' if peak.expert_parameters else ''}, {peak.layers} layers",
            "  model state per GPU: " + ", ".join(f"{k.replace('_', ' ')} {size(v)} ({per[k]:g} B/param)"
                                                   for k, v in state.items())
            + f" = {size(sum(state.values()))}",
            f"  rough activations (seq {layout.seq_length}, micro-batch "
            f"{layout.micro_batch_size if layout.pp > 1 else layout.global_batch_size // layout.dp}): "
            + ", ".join(f"stage {r.pp_rank} {size(self.activations(r))}" for r in self.ranks)
            + f"; fullest GPU (stage {worst.pp_rank}) ~{size(sum(self.model_state(worst).values()) + self.activations(worst))} in all",
        ]
        return "\n".join(lines)


def validate(layout: Layout, module: nn.Module) -> None:
    """The checks the strategy and the data module make before any collective (sizes that do not divide)."""
    cp = layout.context_parallel_size
    if layout.world != layout.tp * layout.pp * cp * layout.dp:
        raise ValueError(f"{layout.name}: {layout.world} GPUs do not make tp {layout.tp} x pp {layout.pp} x cp {cp} x "
                         f"dp {layout.dp}.")
    if layout.global_batch_size % layout.dp:
        raise ValueError(f"{layout.name}: global_batch_size={layout.global_batch_size} does not divide over dp={layout.dp}.")
    config = ParallelConfig(tensor_parallel_size=layout.tp, pipeline_parallel_size=layout.pp, data_parallel_size=layout.dp,
                            sequence_parallel=layout.sequence_parallel, zero_stage=layout.zero_stage,
                            virtual_pipeline_size=layout.vpp, pipeline_layers_per_stage=layout.layers_per_stage,
                            expert_parallel_size=layout.expert_parallel_size, context_parallel_size=cp)
    if hasattr(module, "validate_parallel_config"):
        module.validate_parallel_config(config)
    if layout.pp > 1:
        check_schedule(layout.schedule, layout.vpp)
        check_micro_batches(schedule=layout.schedule, batch_size=layout.global_batch_size // layout.dp,
                            micro_batch_size=layout.micro_batch_size, pipeline_parallel_size=layout.pp)
    if layout.seq_length % (2 * cp):
        raise ValueError(f"{layout.name}: context parallelism cuts seq_length={layout.seq_length} into 2 x cp = {2 * cp} "
                         f"chunks.")
    if layout.sequence_parallel and (layout.seq_length // cp) % layout.tp:
        raise ValueError(f"{layout.name}: sequence parallelism splits seq_length={layout.seq_length} over tp={layout.tp}.")


def report(path: Path, nodes: Optional[int] = None) -> Report:
    layout = Layout.from_yaml(path, nodes)
    module = build_module(layout)
    validate(layout, module)
    total = module.config.num_parameters() if hasattr(module.config, "num_parameters") else sum(
        p.numel() for p in dict.fromkeys(module.parameters()))
    return Report(layout, total, [count_rank(layout, r) for r in range(layout.pp)])


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", type=Path, help="YAML files (default: every configs/*.yaml)")
    parser.add_argument("--nodes", type=int, help="override trainer.num_nodes (changes dp, hence ZeRO's 1/N)")
    args = parser.parse_args(argv)
    for path in args.configs or sorted(CONFIGS.glob("*.yaml")):
        print(report(path, args.nodes).describe(), flush=True)


if __name__ == "__main__":
    main()
