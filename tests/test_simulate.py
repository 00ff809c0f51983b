"""``lightning_megatron.simulate``: one rank of an N-rank job's real set-up and training step on fake tensors over
torch's fake process group, held to formulas written here from the layout (1,024 ranks: the groups, the gradient
buckets, the collectives of one optimizer step per group), to the planner's model-state bytes (16 ranks) and to
what the strategy reports in a real 4-process run (the pooled ``plan_bytes`` job of ``tests/test_plan.py``)."""

import math
from dataclasses import replace

import pytest
import torch.distributed as dist

from lightning_megatron.models import GPT, GPTConfig
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.plan.inventory import fake_world
from lightning_megatron.simulate.fake_world import StageMailbox
from lightning_megatron.simulate.step import Job, simulate_rank
from lightning_megatron.strategy.options import StrategyOptions

# ----------------------------------------------------------------------------------------------------------------
# 1,024 ranks: tp 8 x pp 4 x dp 32 (mesh order pp, dp, cp, tp: tp innermost), sequence parallelism, ZeRO-1.

TP, PP, DP = 8, 4, 32
WORLD = TP * PP * DP
H, LAYERS, HEADS, FFN, VOCAB, SEQ = 48, 8, 8, 128, 256, 32
MICRO_BATCHES = 6  # per optimizer step and dp rank (micro_batch_size 1): more than pp, so 1F1B has a steady phase
CHUNK = 16  # loss_chunk_tokens: the last stage's loss runs the head on 16 tokens at a time
BUCKET_MB = 0.008  # ~8 KiB buckets: a stage's two layers are cut into several
BF16 = 2


def tiny_gpt() -> GPT:
    """Llama-shaped (RMSNorm, SwiGLU, rope, no biases), tied embeddings, hidden 48: 8 heads of 6 (one per tp rank
    and query group; a norm's 48 elements make bucket sizes that need ZeRO's padding), vocabulary 256 (padded to
    tp x 128 = 1,024 rows, 128 per tp rank)."""
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_length=SEQ, hidden_size=H, num_layers=LAYERS, num_heads=HEADS,
                         num_query_groups=HEADS, ffn_hidden_size=FFN, dropout=0.0, normalization="RMSNorm",
                         position_embedding_type="rope", activation="swiglu", add_bias_linear=False,
                         tie_embeddings=True, loss_chunk_tokens=CHUNK))


def rank_of(pp: int, dp: int, tp: int) -> int:
    return (pp * DP + dp) * TP + tp


def test_groups_at_1024_ranks_are_their_formulas(no_process_group):
    """tp: blocks of 8 consecutive ranks; dp: the ranks 8 apart with the same pp stage; pp: ranks 256 (tp x dp x cp)
    apart; the model-parallel group: one replica's tp x pp ranks; the embedding group: the first and last stage of
    one (dp, tp) coordinate; with cp 2 (tp 4) the cp group is 4 apart and the replicas' group is dp x cp."""
    config = ParallelConfig.for_world(WORLD, tensor_parallel_size=TP, pipeline_parallel_size=PP)
    for rank in (0, 7, 8, 300, 507, 768, 1023):
        pp, dp, tp = rank // (DP * TP), rank // TP % DP, rank % TP
        with fake_world(WORLD, rank):
            state = ParallelState.create(config, "cpu")
            members = lambda group: dist.get_process_group_ranks(group)  # noqa: E731
            assert (state.pipeline_parallel_rank, state.data_parallel_rank, state.tensor_parallel_rank) == (pp, dp, tp)
            assert members(state.tensor_parallel_group) == list(range(rank - tp, rank - tp + TP))
            assert members(state.data_parallel_group) == [rank_of(pp, d, tp) for d in range(DP)]
            assert members(state.replica_group) == members(state.data_parallel_group)
            assert members(state.pipeline_parallel_group) == [rank_of(p, dp, tp) for p in range(PP)]
            assert members(state.model_parallel_group) == sorted(rank_of(p, dp, t) for p in range(PP)
                                                                  for t in range(TP))
            if pp in (0, PP - 1):
                assert members(state.embedding_group) == [rank_of(0, dp, tp), rank_of(PP - 1, dp, tp)]
            else:
                assert state.embedding_group is None
    cp_config = ParallelConfig.for_world(WORLD, tensor_parallel_size=4, context_parallel_size=2,
                                         pipeline_parallel_size=PP)
    for rank in (0, 5, 1023):
        with fake_world(WORLD, rank):
            state = ParallelState.create(cp_config, "cpu")
            pp, dp, cp, tp = rank // 256, rank // 8 % 32, rank // 4 % 2, rank % 4
            assert (state.pipeline_parallel_rank, state.data_parallel_rank, state.context_parallel_rank,
                    state.tensor_parallel_rank) == (pp, dp, cp, tp)
            cp_group = dist.get_process_group_ranks(state.context_parallel_group)
            assert cp_group == [rank - 4 * cp + 4 * c for c in range(2)]
            assert dist.get_process_group_ranks(state.replica_group) == [
                pp * 256 + d * 8 + c * 4 + tp for d in range(32) for c in range(2)]


def stage_parameters(pp: int) -> list[tuple[str, int]]:
    """This stage's parameters (name, elements on one tp rank) in ``module.parameters()`` order: the embedding
    (vocabulary rows of this tp rank) on the first stage, then per layer the two norms (replicated), qkv (a head
    and its key and value per tp rank: 3 x 6 rows), the output projection (6 of its 48 columns), SwiGLU's fused
    gate/up (2 x 128 / 8 rows) and down projection (16 columns); the final norm and the output layer (tied to the
    embedding, a copy of it on the last stage) last."""
    vocab_rows = math.ceil(VOCAB / (128 * TP)) * 128
    head_dim = H // HEADS
    per_layer = [("ln_1", H), ("qkv", 3 * HEADS // TP * head_dim * H), ("attn.proj", H * H // TP), ("ln_2", H),
                 ("fc", 2 * FFN // TP * H), ("mlp.proj", H * FFN // TP)]
    params = [("embedding", vocab_rows * H)] if pp == 0 else []
    layers = range(pp * LAYERS // PP, (pp + 1) * LAYERS // PP)
    params += [(f"{layer}.{name}", numel) for layer in layers for name, numel in per_layer]
    if pp == PP - 1:
        params += [("ln_f", H), ("lm_head", vocab_rows * H)]
    return params


def buckets_of(params: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """Megatron-Core's buckets (``optim/grad_sync.py``): the parameters in reverse order, a bucket closed once it
    holds at least ``bucket_size_mb``; the pipeline-tied embedding in a bucket of its own (the same layout, hence
    the same owned slice, on the first and the last stage)."""
    limit, buckets, pending, size = int(BUCKET_MB * 2**20), [], [], 0
    for name, numel in reversed(params):
        alone = name in ("embedding", "lm_head")
        if pending and (alone or size >= limit):
            buckets.append(pending)
            pending, size = [], 0
        pending.append((name, numel))
        size += numel * BF16
        if alone:
            buckets.append(pending)
            pending, size = [], 0
    return buckets + ([pending] if pending else [])


def owned_elements(bucket: list[tuple[str, int]], dp_rank: int) -> dict[str, int]:
    """ZeRO: a bucket padded to a multiple of dp, dp rank r owning its r-th slice; the elements of each parameter
    in it (the last ranks' slices are partly padding)."""
    total = sum(numel for _, numel in bucket)
    shard = math.ceil(total / DP)
    lo, hi, offset, owned = dp_rank * shard, (dp_rank + 1) * shard, 0, {}
    for name, numel in bucket:
        owned[name] = max(0, min(hi, offset + numel) - max(lo, offset))
        offset += numel
    return owned


def padded(bucket) -> int:
    return math.ceil(sum(numel for _, numel in bucket) / DP) * DP


def expected_step(pp: int, dp: int) -> tuple[dict, dict]:
    """The model state and the collectives of one optimizer step of the rank at (pp, dp), from the layout (the plain
    loss is the chunked one with a single chunk of the whole sequence: ``CHUNK = SEQ``)."""
    params = stage_parameters(pp)
    buckets = buckets_of(params)
    owned = {}
    for bucket in buckets:
        owned.update(owned_elements(bucket, dp))
    first, last = pp == 0, pp == PP - 1
    m, layers = MICRO_BATCHES, LAYERS // PP
    hidden = SEQ * H * BF16  # one micro-batch's hidden states, whole sequence ([S, 1, H] bf16)
    chunks, chunk = SEQ // CHUNK, CHUNK * H * BF16  # the loss's chunks, the bytes of one's hidden states
    state = {"parameters": BF16 * sum(n for _, n in params), "gradients": BF16 * sum(map(padded, buckets)),
             "main_parameters": 4 * sum(owned.values()), "optimizer_state": 8 * sum(owned.values())}
    rows = {
        # ZeRO-1: one reduce-scatter of each whole (padded) bucket, one all-gather of the updated parameters into it.
        ("reduce_scatter", "dp x cp"): (len(buckets), BF16 * sum(map(padded, buckets))),
        ("all_gather", "dp x cp"): (len(buckets), BF16 * sum(map(padded, buckets))),
        # The token guess (max), the token count with the non-finite flag, the squared gradient norm: float64.
        ("all_reduce", "dp x cp"): (3, 8 + 16 + 8),
        ("all_reduce", "model parallel"): (1, 8),  # the squared norm, over the replica's tp x pp ranks
        # 1F1B, sequence parallel activations ([S / tp, 1, H]): each boundary once forward, once backward.
        ("send", "pp"): ((1 if first or last else 2) * m, (1 if first or last else 2) * m * hidden // TP),
        ("recv", "pp"): ((1 if first or last else 2) * m, (1 if first or last else 2) * m * hidden // TP),
        # Sequence parallelism per layer and micro-batch: qkv and fc gather their input forward and again for
        # their weight gradient, the output projections gather their output gradient: 6; the two projections'
        # outputs and the two column layers' input gradients are reduce-scattered: 4. The embedding's output is
        # all-reduced and its gradient gathered from the sequence shards; the chunked head gathers each chunk's
        # input (CHUNK tokens) forward and for its weight gradient and reduce-scatters its input gradient; the
        # vocab-parallel cross-entropy all-reduces the max, the sum of exponentials and the target logit (fp32 per
        # token).
        ("all_gather", "tp"): (m * (6 * layers + first + 2 * chunks * last),
                               m * ((6 * layers + first) * hidden + 2 * chunks * last * chunk)),
        ("reduce_scatter", "tp"): (m * (4 * layers + chunks * last), m * (4 * layers * hidden + chunks * last * chunk)),
    }
    # The norms' gradients are partial sums over tp under sequence parallelism: one all-reduce per step of the
    # elements this dp rank owns (none owned: no all-reduce).
    norm_owned = sum(n for name, n in owned.items() if name.endswith(("ln_1", "ln_2", "ln_f")))
    tp_reduces = [(m * first, m * first * hidden), (3 * chunks * m * last, 3 * chunks * m * last * CHUNK * 4),
                  (int(norm_owned > 0), BF16 * norm_owned)]
    rows[("all_reduce", "tp")] = tuple(map(sum, zip(*tp_reduces)))
    if first or last:  # the tied embedding's gradient: the owned slice summed over the first and last stage
        tied = "embedding" if first else "lm_head"
        rows[("all_reduce", "embedding")] = (int(owned[tied] > 0), BF16 * owned[tied])
    return state, {key: value for key, value in rows.items() if value[0]}


@pytest.fixture(scope="module")
def simulated_1024():
    """The first rank, a middle stage's last dp rank and the last rank of the 1,024-rank job, simulated once."""
    if dist.is_initialized():
        dist.destroy_process_group()  # an in-process Trainer earlier in the session (conftest's no_process_group)
    options = StrategyOptions(tensor_parallel_size=TP, pipeline_parallel_size=PP, sequence_parallel=True,
                              zero_stage=1, micro_batch_size=1, bucket_size_mb=BUCKET_MB)
    job = Job(tiny_gpt, options, world_size=WORLD, precision="bf16-true", loader_batch_size=DP * MICRO_BATCHES,
              seq_length=SEQ, gradient_clip_val=1.0)
    mailbox = StageMailbox()
    return {rank: simulate_rank(job, rank, mailbox) for rank in (rank_of(0, 0, 0), rank_of(1, DP - 1, 3), WORLD - 1)}


@pytest.mark.parametrize("rank", [rank_of(0, 0, 0), rank_of(1, DP - 1, 3), WORLD - 1])
def test_buckets_and_collectives_at_1024_ranks_are_their_formulas(simulated_1024, rank):
    """Model state (padded gradient buckets, owned fp32 slices) and every collective of the measured step, count and
    bytes per (kind, group), equal the formulas of :func:`expected_step`; nothing else is issued."""
    result = simulated_1024[rank]
    pp, dp, tp = rank // (DP * TP), rank // TP % DP, rank % TP
    assert result.coordinates == {"pp": pp, "dp": dp, "tp": tp}
    state, rows = expected_step(pp, dp)
    assert result.model_state_bytes == state
    measured = {(row["kind"], row["group"]): (row["count"], row["bytes"]) for row in result.collectives}
    assert measured == rows
    assert result.stand_ins < result.host_reads  # most host reads are of values the simulation knows


# ----------------------------------------------------------------------------------------------------------------
# 16 ranks: the model state of each simulated rank is the planner's prediction for its coordinates, byte for byte.


def llama_tiny(moe: bool = False) -> GPT:
    from lightning_megatron.models.moe import MoEConfig

    config = GPTConfig.from_name("llama-tiny", dropout=0.0, max_seq_length=SEQ)
    if moe:
        config = replace(config, moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32))
    return GPT(config)


# layout key -> (strategy options, precision, MoE model, accumulate_grad_batches, ranks simulated: stages in order)
LAYOUTS_16 = {
    "tp2-pp2-dp4-sp-z1": (dict(tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=True,
                               zero_stage=1, micro_batch_size=1), "bf16-true", False, 1, (0, 15)),
    "tp2-dp8-z2-acc2": (dict(tensor_parallel_size=2, zero_stage=2), "bf16-true", False, 2, (15,)),
    "tp2-cp2-dp4-z1-fp32": (dict(tensor_parallel_size=2, context_parallel_size=2, zero_stage=1), "32-true", False, 1,
                            (15,)),
    "moe-tp2-ep2-dp8-z1": (dict(tensor_parallel_size=2, expert_parallel_size=2, zero_stage=1), "bf16-true", True, 1,
                           (15,)),
}


@pytest.mark.parametrize("key", list(LAYOUTS_16))
def test_16_ranks_model_state_is_the_planners(key, no_process_group):
    """tp2 x pp2 x dp4 with sequence parallelism (both pipeline stages), ZeRO-2 under gradient accumulation,
    context parallelism in fp32 and experts over ep2 (bf16-true elsewhere, ~10 KiB buckets): each simulated rank's
    model state is ``Planner.model_state_bytes`` at its coordinates. ZeRO-2 reduce-scatters each bucket after every
    micro-batch, ZeRO-1 once a step; both all-gather the updated parameters once a step."""
    from lightning_megatron.plan import GPUS, Planner, Workload

    strategy, precision, moe, accumulation, ranks = LAYOUTS_16[key]
    job = Job(lambda: llama_tiny(moe), StrategyOptions(**strategy, bucket_size_mb=0.01), world_size=16,
              precision=precision, loader_batch_size=32, seq_length=SEQ, accumulate_grad_batches=accumulation,
              gradient_clip_val=1.0)
    workload = Workload(global_batch_size=32 * accumulation, seq_length=SEQ, precision=precision,
                        bucket_size_mb=0.01)
    planner = Planner(lambda: llama_tiny(moe), workload, GPUS["a100"], world_size=16)
    layout = planner.with_layout(**strategy)
    mailbox = StageMailbox()
    for rank in ranks:
        result = simulate_rank(job, rank, mailbox)
        where = result.coordinates
        assert where["pp"] == rank * layout.pipeline_parallel_size // 16
        predicted = planner.model_state_bytes(layout, pipeline_rank=where["pp"], data_rank=where["dp"],
                                              context_rank=where.get("cp", 0))
        assert result.model_state_bytes == predicted, (rank, where)
        rows = {(row["kind"], row["group"]): row["count"] for row in result.collectives}
        reductions = accumulation if strategy["zero_stage"] == 2 else 1
        assert rows[("reduce_scatter", "dp x cp")] == reductions * rows[("all_gather", "dp x cp")], rows


# ----------------------------------------------------------------------------------------------------------------
# 4 ranks: the model state the strategy reported in a real 4-process run (the pooled plan_bytes job).

# BYTE_LAYOUTS keys -> the ranks simulated: the last rank (last pipeline stage, last dp rank: the ZeRO slices with
# the padding), and the first of a pipelined layout (stages in order). The layouts the simulation does not run yet:
# ZeRO-3, and bf16-mixed with clipping, experts in fp32 (see the report of issue 44).
MEASURED = {"dp4-z1": (3,), "dp4-z2-bf16": (3,), "pp2v2-dp2-z2-bf16": (0, 3), "lora-tp2-dp2-z1-bf16": (3,)}


@pytest.mark.slow  # the 4-rank job (shared with tests/test_plan.py: conftest's plan_bytes_job, once a session)
def test_model_state_is_what_a_real_4_process_run_reported(plan_bytes_job, no_process_group):
    """ZeRO-1 in fp32 and ZeRO-2 in bf16 with tied embeddings, interleaved pp2 x vpp2 under ZeRO-2, LoRA (its base
    frozen) at tp2 under ZeRO-1: each simulated rank's model state is what ``strategy.model_state_bytes``
    reported on that rank after a real step of the same layout and model (``tests/workers/plan_bytes.py``)."""
    import sys

    from launch import WORKERS

    sys.path.insert(0, str(WORKERS))
    from plan_layouts import BYTE_LAYOUTS, byte_model

    results, _ = plan_bytes_job
    for key, ranks in MEASURED.items():
        case = BYTE_LAYOUTS[key]
        job = Job(lambda: byte_model(case),
                  StrategyOptions(**case["strategy"], bucket_size_mb=case["bucket_size_mb"]), world_size=4,
                  precision=case["precision"], loader_batch_size=8, seq_length=SEQ, gradient_clip_val=1.0)
        mailbox = StageMailbox()
        for rank in ranks:
            simulated = simulate_rank(job, rank, mailbox)
            pp, dp, cp, tp = results[rank][key]["coordinates"]
            where = simulated.coordinates
            assert (where["pp"], where["dp"], where["tp"]) == (pp, dp, tp)
            assert simulated.model_state_bytes == results[rank][key]["bytes"], (key, rank)


# benchmarks/memory/peak.py's layouts compared (pp 1 without recomputation; see the report of issue 44 for the
# others): tp 1 and 2, sequence parallelism, GPT- and Llama-shaped models, latent attention, the chunked loss at
# Llama-3's vocabulary.
PEAK_LAYOUTS = ("tp1-none", "llama-tp2-sp-none", "mla-tp2-sp-none", "chunk-llama3-tp1-none")


@pytest.mark.slow  # the 2-rank activation job (shared with tests/test_plan.py: conftest's activation_peak_job)
def test_activation_peaks_are_what_the_real_2_process_run_measured(activation_peak_job, no_process_group):
    """Each layout simulated as ``benchmarks/memory/peak.py`` runs it (fp32, ZeRO 0, 2 ranks, AdamW, no clipping):
    the simulated step's activations and temporaries at its peak are the measured peak of the forward and backward
    (what they allocate and keep alive, model state left out) plus what the measurement leaves out as older than
    the step: the rotary cos/sin tables (``[seq, head_dim]`` fp32 each, cached from the warm-up step; the cache is
    emptied first: it outlives a simulation), this rank's batch (input ids and labels, int64) and scalars (the
    optimizer's step counters, token counts, flags: 4 or 8 bytes each, under 512 bytes in all). The simulation runs
    FlashAttention's op where the measurement runs torch's CPU kernel: at these head widths both keep the same."""
    from benchmarks.memory.peak import LAYOUTS_BY_KEY, model_config

    from lightning_megatron.models.rotary import _cos_sin_from_zero

    for key in PEAK_LAYOUTS:
        layout = LAYOUTS_BY_KEY[key]
        assert layout.pipeline_parallel_size == 1
        options = StrategyOptions(tensor_parallel_size=layout.tensor_parallel_size,
                                  sequence_parallel=layout.sequence_parallel,
                                  activation_checkpointing=layout.activation_checkpointing,
                                  micro_batch_size=layout.micro_batch_size, bucket_size_mb=25.0)
        rows = layout.micro_batch_size * layout.micro_batches
        job = Job(lambda: GPT(model_config(layout)), options, world_size=2, precision="32-true",
                  loader_batch_size=rows * layout.data_parallel_size, seq_length=layout.seq_length,
                  accumulate_grad_batches=layout.micro_batches)
        _cos_sin_from_zero.cache_clear()
        simulated = simulate_rank(job, 0, StageMailbox())
        measured = activation_peak_job[0][key]["peak_bytes"]
        config = model_config(layout)
        rotary = 0 if config.position_embedding_type != "rope" else 2 * layout.seq_length * (
            config.mla.qk_rope_head_dim if config.mla else config.hidden_size // config.num_heads) * 4
        older = rotary + 2 * rows * layout.seq_length * 8
        split = simulated.peak_by_category
        extra = split["activations"] + split["temporaries"] - measured - older
        assert abs(extra) < 512, (key, split, measured, older)
