"""Train tiny GPT, Llama-shaped and BERT models for a few steps at several context-parallel layouts over the same
processes, count the ring's messages, and generate under context parallelism.

argv: OUT_DIR LAYOUTS, a comma list of
``<model>-cp{C}[-pp{P}]-tp{T}-dp{D}[-sp][-mb{M}][-z{Z}][-rc|-sel][-ag][-fp8t|-fp8r][-s{N}]``
(models: ``gpt`` learned positions, ``llama`` rotary + grouped-query, ``qwen3`` with q/k norms and wider heads, ``gemma3``
Gemma 3 whole (windows, per-layer rotary bases, sandwich norms, capped logits),
``bert`` bidirectional with padding, ``doc`` and
``llamadoc`` the first two on packed samples with document masks; ``rc``
full and ``sel`` selective recomputation; ``ag`` the all-gather attention; ``fp8t`` / ``fp8r``: the linears in FP8,
tensorwise or rowwise; ``s{N}``: the first N steps), ``count-<layout>`` for the
collectives of one step, ``gen-<layout>`` for greedy generation, ``kernels-<layout>`` for the two attentions against
SDPA in fp64, or ``errors-<layout>`` for what every rank says to bad input. The model is the LightningModule, split by the
strategy's own steps (``parallelize``, ``apply_recompute``, ``prepare_context_parallel``, ``split_pipeline``,
``start_pipeline``, ``build_step_gradients``), and each batch is cut by the splitter the strategy applies. Rank 0
writes each layout's losses and full weights to ``{layout}.pt``.
"""

import re
from pathlib import Path

import torch
import torch.distributed as dist

from entry import run_script
from layout_runs import layouts_job, start_worker_pipeline
from collective_counter import CollectiveCounter
from cp_setup import MODELS, bert_setup, gpt_setup, model_batches, model_loss
from lightning_megatron.checkpoint import gather_full_state_dict, merge_pipeline_stages
from lightning_megatron.models import GPT
from lightning_megatron.optim.nonfinite import NonFiniteCheck
from lightning_megatron.optim.step import build_step_gradients
from lightning_megatron.strategy.options import StrategyOptions
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.strategy.preparation import apply_recompute, prepare_context_parallel, split_pipeline
from lightning_megatron.tensor_parallel import parallelize
from lightning_megatron.tensor_parallel.fp8 import Fp8Recipe
from lightning_megatron.tensor_parallel.fp8_plan import convert_to_fp8

LAYOUT = re.compile(r"(\w+)-cp(\d+)(?:-pp(\d+))?-tp(\d+)-dp(\d+)(-sp)?(?:-mb(\d+))?(?:-z(\d))?(?:-(rc|sel))?(-ag)?"
                    r"(?:-fp8(t|r))?(?:-s(\d+))?")
FP8_RECIPES = {"t": "tensorwise", "r": "rowwise"}
SEED, GLOBAL_BATCH, CLIP = gpt_setup.SEED, gpt_setup.GLOBAL_BATCH, gpt_setup.CLIP
WINDOW = 5  # the kernels' sliding window: wider than cp4's chunks of 4 tokens, narrower than cp2's 8


def parse(layout: str):
    match = LAYOUT.fullmatch(layout)
    cp, pp, tp, dp = int(match[2]), int(match[3] or 1), int(match[4]), int(match[5])
    config = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                            sequence_parallel=bool(match[6]), zero_stage=int(match[8] or 0), context_parallel_size=cp)
    recompute = {"rc": "full", "sel": "selective"}.get(match[9], "none")
    fp8 = match[11] and Fp8Recipe.named(FP8_RECIPES[match[11]])
    return match[1], config, int(match[7] or 1), recompute, "all_gather" if match[10] else "ring", fp8, match[12]


def build(name: str, config: ParallelConfig, micro_batches: int, recompute: str, attention: str, fp8=None):
    state = ParallelState.create(config, "cpu")
    module = MODELS[name]()
    with torch.device("meta"):
        module.configure_model()
    rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, "cpu")
    parallelize(module, module.tensor_parallel_plan(), state, rng=rng)
    convert_to_fp8(module, fp8, state)
    apply_recompute(module, recompute, rng)
    splitter = prepare_context_parallel(module, state, attention)
    split = split_pipeline(module, state)
    initialize_parameters(module, SEED, device="cpu", only_meta=True)
    opt = (bert_setup if name == "bert" else gpt_setup).optimizer(module.parameters())
    step = build_step_gradients(module, state, [opt], StrategyOptions(zero_stage=state.config.zero_stage,
                                bucket_size_mb=0.01), loss_scaler=None, nonfinite=NonFiniteCheck("error", 10),
                                device=torch.device("cpu"))
    root, runner = module.model, None
    if split is not None:
        runner = start_worker_pipeline(split, state, step, GLOBAL_BATCH // config.data_parallel_size // micro_batches)
    return state, module, root, opt, step, runner, splitter


def rank_batch(state, splitter, batch: dict) -> dict:
    """This rank's part: its dp rows (the sampler's), then its context-parallel chunks (the strategy's splitter)."""
    dp = state.config.data_parallel_size
    rows = slice(state.data_parallel_rank * GLOBAL_BATCH // dp, (state.data_parallel_rank + 1) * GLOBAL_BATCH // dp)
    batch = {key: value[rows] for key, value in batch.items()}
    return batch if splitter is None else splitter(batch)


def train_step(state, root, step, runner, batch, micro_batches):
    """One step's forward and backward as the strategy runs them; returns (loss sum, tokens) of this rank."""
    if runner is not None:
        loss_sum, tokens = model_loss(root, batch)
        step.add_tokens(tokens)
        return loss_sum, tokens
    total, count = torch.zeros(()), torch.zeros((), dtype=torch.long)
    pieces = [{key: value.chunk(micro_batches)[i] for key, value in batch.items()} for i in range(micro_batches)]
    for i, piece in enumerate(pieces):
        step.sync.start_micro_batch(sync=i == len(pieces) - 1)
        loss_sum, tokens = model_loss(root, piece)
        (loss_sum * step.backward_scale(tokens, accumulation=micro_batches, loss_scale=1.0)).backward()
        step.add_tokens(tokens)
        total, count = total + loss_sum.detach(), count + tokens
    return total, count


def train(layout: str):
    name, config, micro_batches, recompute, attention, fp8, steps = parse(layout)
    state, module, root, opt, step, runner, splitter = build(name, config, micro_batches, recompute, attention, fp8)
    losses = []
    for batch in model_batches(name)[:int(steps or gpt_setup.STEPS)]:
        loss_sum, tokens = train_step(state, root, step, runner, rank_batch(state, splitter, batch), micro_batches)
        step.finish(accumulation=1 if runner is not None else micro_batches, loss_scale=1.0)
        norm, _ = step.check_finite(opt.param_groups, step=len(losses), epoch=0)
        step.clip(opt.param_groups, CLIP, norm=norm)
        opt.step()
        step.after_step()
        totals = torch.stack([loss_sum.detach().float(), tokens.float()])
        if state.replica_group is not None:  # every dp x cp rank holds other tokens
            dist.all_reduce(totals, group=state.replica_group)
        losses.append((totals[0] / totals[1]).item())
    weights = merge_pipeline_stages(gather_full_state_dict(root, state.tensor_parallel_group),
                                    state.pipeline_parallel_group)
    step.remove()
    return losses, weights


def count(layout: str) -> dict:
    """The collectives of one step's forward and of its backward (no gradient reduction), as ``"<kind>/<group>":
    calls``; point-to-point messages counted one per tensor sent or received."""
    name, config, _, recompute, attention, _, _ = parse(layout.removeprefix("count-"))
    state, module, root, opt, step, runner, splitter = build(name, config, 1, recompute, attention)
    batch = rank_batch(state, splitter, model_batches(name)[0])
    names = (("replicas", state.replica_group), ("dp", state.data_parallel_group), ("tp", state.tensor_parallel_group),
             ("pp", state.pipeline_parallel_group), ("cp", state.context_parallel_group))  # cp wins where they coincide
    step.sync.start_micro_batch(sync=False)
    with CollectiveCounter(names) as calls:
        loss_sum, tokens = model_loss(root, batch)
        forward = calls.take()
        loss_sum.backward()
        backward = calls.take()
    step.remove()
    return {"forward": forward, "backward": backward}


def kernels(layout: str) -> dict:
    """Ring and all-gather attention against SDPA over the whole sequence, in fp64, forward and backward: causal and
    bidirectional with key padding, causal within packed documents (against SDPA over the dense mask; documents
    of one token and across chunk boundaries, tiles of 3 positions), the same with a sliding window of
    ``WINDOW`` keys across chunks and ranks, multi-head and grouped-query; the worst deviation of each."""
    import torch.nn.functional as F

    from lightning_megatron.context_parallel import chunk_indices, ring_order
    from lightning_megatron.context_parallel.all_gather import all_gather_attention
    from lightning_megatron.context_parallel.documents import DocumentMask
    from lightning_megatron.context_parallel.ring import ring_attention
    from lightning_megatron.models.softcap import softcapped_attention

    _, config, _, _, _, _, _ = parse(layout.removeprefix("kernels-"))
    state = ParallelState.create(config, "cpu")
    group, size, rank = state.context_parallel_group, config.context_parallel_size, state.context_parallel_rank
    generator = torch.Generator().manual_seed(SEED)
    worst: dict = {}
    for heads, groups in ((4, 4), (4, 2), (4, 1)):
        batch, seq, dim = 2, 8 * size, 8
        q, k, v, grad = (torch.randn(batch, h, seq, dim, generator=generator, dtype=torch.float64)
                         for h in (heads, groups, groups, heads))
        padding = torch.ones(batch, seq, dtype=torch.bool)
        padding[1, -5:] = False
        starts = torch.rand(batch, seq, generator=generator) < 0.3
        starts[:, 0] = starts[1, :] = True  # the second sample: documents of one token
        documents = DocumentMask(starts.long().cumsum(1), tile=3)
        mine, order = chunk_indices(seq, size, rank), ring_order(seq, size)
        positions = torch.arange(seq)
        band = (positions[:, None] - positions[None, :]) < WINDOW  # with causal: the WINDOW latest keys
        # "sinks": GPT-OSS's sink logits (merged once into each query's softmax, after every rank's keys) over
        # documents in a window, against the dense softmax with the sink column (models.softcap), sinks' gradients too
        sinks = torch.randn(heads, generator=generator, dtype=torch.float64)
        for case in ("causal", "bidirectional", "padded", "documents", "window", "sinks"):
            causal = case in ("causal", "documents", "window", "sinks")
            windowed = case in ("window", "sinks")
            mask = {"padded": padding[:, None, None, :], "documents": documents.dense(causal=True),
                    "window": documents.dense(causal=True) & band, "sinks": documents.dense(causal=True) & band}.get(case)
            full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            if case == "sinks":
                expected = softcapped_attention(*full[:3], mask, cap=None, sinks=full[3])
            else:
                expected = F.scaled_dot_product_attention(*full[:3], attn_mask=mask, is_causal=case == "causal",
                                                          enable_gqa=groups != heads)
            (expected * grad).sum().backward()
            for name, attention in (("ring", ring_attention), ("all_gather", all_gather_attention)):
                local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
                local_sinks = sinks.clone().requires_grad_() if case == "sinks" else None
                out = attention(*local, causal=causal, group=group,
                                key_mask=padding[:, order] if case == "padded" else None,
                                documents=DocumentMask(documents.ids[:, order], 3) if case in ("documents", "window",
                                                                                             "sinks") else None,
                                window=WINDOW if windowed else None, sinks=local_sinks)
                (out * grad[:, :, mine]).sum().backward()
                deviations = [(out - expected[:, :, mine]).abs().max()] + [
                    (mine_t.grad - full_t.grad[:, :, mine]).abs().max() for mine_t, full_t in zip(local, full)]
                if local_sinks is not None:  # this rank's queries' share, summed over cp as the gradients are
                    dist.all_reduce(local_sinks.grad, group=group)
                    deviations.append((local_sinks.grad - full[3].grad).abs().max())
                worst[f"{name}-{case}-{heads}h{groups}g"] = max(float(d) for d in deviations)
    return worst


def errors(layout: str) -> dict:
    """What each rank says, before any collective, to a batch it cannot cut or a model it cannot split."""
    from lightning_megatron.context_parallel import apply_context_parallel
    from lightning_megatron.context_parallel.apply import BatchSplitter

    _, config, _, _, _, _, _ = parse(layout.removeprefix("errors-"))
    state = ParallelState.create(config, "cpu")
    said = {}
    splitter = BatchSplitter(GPT(gpt_setup.CONFIG), state)
    try:
        splitter({"input_ids": torch.zeros(2, 12, dtype=torch.long), "labels": torch.zeros(2, 12)})
    except ValueError as error:
        said["length"] = str(error)
    try:
        apply_context_parallel(torch.nn.Sequential(torch.nn.Linear(4, 4)), state)
    except ValueError as error:
        said["attention"] = str(error)
    return said


def generate_at(layout: str) -> dict:
    """Greedy generation under context parallelism: whole prompts on every rank (the split attention steps aside),
    the tokens of one process."""
    from lightning_megatron.generation import generate

    name, config, _, _, attention, _, _ = parse(layout.removeprefix("gen-"))
    state, module, root, opt, step, runner, splitter = build(name, config, 1, "none", attention)
    step.remove()
    torch.manual_seed(SEED)
    reference = MODELS[name]()
    reference.configure_model()
    prompts = [[5, 6, 7], [1, 2, 3, 4, 9]]
    return {"expected": generate(reference.model.eval(), prompts, max_new_tokens=6),
            "got": generate(root, prompts, max_new_tokens=6)}


def main(out_dir: Path, args: list[str]) -> None:
    layouts_job(out_dir, args[0].split(","), train, {"count-": count, "gen-": generate_at, "kernels-": kernels, "errors-": errors})


if __name__ == "__main__":
    run_script(main)
