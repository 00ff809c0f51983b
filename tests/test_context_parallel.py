"""Context parallelism: the batch cut and the refusals in one process, then one 4-rank launch with the layout matrix
(GPT with learned positions, Llama-shaped with rotary and grouped-query attention, BERT with padding, each against
one process), the two attentions against SDPA, the ring's messages counted, generation and bad input."""

from dataclasses import replace

import pytest
import torch

from launch import run_job
from test_layout_invariance import _deviations
from workers import bert_setup, gpt_setup
from workers.cp_setup import BERT_CONFIG, MODELS, model_batches, model_loss
from lightning_megatron.context_parallel import SequenceInputs, apply_context_parallel, chunk_indices, split_batch
from lightning_megatron.context_parallel.apply import BatchSplitter
from lightning_megatron.models import BERT, GPT, BERTConfig
from lightning_megatron.parallel import ParallelConfig, ParallelState

# <model>-cp{C}[-pp{P}]-tp{T}-dp{D}[-sp][-mb{M}][-z{Z}][-rc|-sel][-ag] on 4 ranks (tests/workers/cp_layouts.py).
LAYOUTS = [
    "gpt-cp4-tp1-dp1",              # learned positions follow the chunks
    "gpt-cp2-tp2-dp1-sp",           # each rank's chunks split again over tp by sequence parallelism
    "gpt-cp2-pp2-tp1-dp1-mb2",      # the ring inside pipeline stages, two micro-batches
    "gpt-cp2-tp1-dp2-z1",           # gradients summed over dp x cp in one go, ZeRO-1 over the 4 replicas
    "llama-cp4-tp1-dp1",            # rotary positions, grouped-query ring
    "llama-cp2-tp2-dp1-sp-mb2-rc",  # + full recomputation: the ring replayed in backward
    "llama-cp2-pp2-tp1-dp1-mb2",
    "llama-cp2-tp1-dp2-z1-ag",      # the all-gather attention
    "gpt-cp4-tp1-dp1-sel-ag",       # selective recomputation of the all-gather attention
    "bert-cp4-tp1-dp1",             # bidirectional: every block whole, the padding mask of every rank's keys
    "bert-cp2-tp2-dp1-sp",
    "bert-cp2-pp2-tp1-dp1-mb2",
    "bert-cp2-tp1-dp2-z1",
    "llamadoc-cp2-tp2-dp1-sp",      # packed documents: every rank reads the document ids of every key (ring, SP)
    "doc-cp2-tp1-dp2-ag",           # the same with the all-gather attention
    "doc-cp4-tp1-dp1-sel",          # documents across the 2-token chunks of cp4, attention recomputed in backward
    "chunk-cp2-tp2-dp1-sp",         # the chunked loss on each rank's chunks, against the unchunked GPT's reference
    "window-cp2-tp2-dp1-sp",        # sliding windows across the ring's chunks, tp2 + SP
    "windowdoc-cp2-tp1-dp2-ag",     # the same over packed documents, all-gather attention
    "qwen3-cp2-tp2-dp1-sp",         # q/k norms on each rank's heads and chunks, 16-channel heads of a 32-wide model
    "gemma3-cp2-tp1-dp2",           # Gemma 3 whole (test_layout_invariance.py: its reference is transformers')
    "mladoc-cp2-tp2-dp1-sp",        # latent attention (padded values, one shared rotary key) over packed documents
    "sinkwindow-cp2-tp2-dp1-sp",    # GPT-OSS's sinks split with the heads over tp, merged once by the ring, windows
]
COUNTS = ["count-gpt-cp4-tp1-dp1", "count-llama-cp2-tp1-dp2", "count-bert-cp2-tp2-dp1-sp", "count-llama-cp4-tp1-dp1-ag"]
EXTRAS = ["kernels-gpt-cp4-tp1-dp1", "kernels-gpt-cp2-tp1-dp2", "gen-llama-cp2-tp2-dp1-sp", "errors-gpt-cp4-tp1-dp1"]
# FP8 (tensorwise "t", rowwise "r"): the activations' and gradients' amaxes reduced over cp too, against one process
# running the same dp pieces of the batch in fp8, whole sequences, the first step (test_layout_invariance.py says why).
FP8_LAYOUTS = {"gpt-cp2-tp1-dp2-fp8t-s1": "gpt-cp1-tp1-dp1-mb2-fp8t-s1",
               "gpt-cp2-tp2-dp1-sp-fp8r-s1": "gpt-cp1-tp1-dp1-fp8r-s1",
               "gpt-cp4-tp1-dp1-fp8t-s1": "gpt-cp1-tp1-dp1-fp8t-s1",
               "gpt-cp2-tp1-dp2-ag-fp8r-s1": "gpt-cp1-tp1-dp1-mb2-fp8r-s1",
               # Qwen3's q/k norms stay in high precision, its wider heads' qkv and proj run in FP8
               "qwen3-cp2-tp1-dp2-fp8r-s1": "qwen3-cp1-tp1-dp1-mb2-fp8r-s1"}


def test_each_rank_holds_an_early_and_a_late_chunk_and_together_every_position():
    for size in (1, 2, 4):
        held = [chunk_indices(32, size, rank) for rank in range(size)]
        assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(32))
        chunk = 32 // (2 * size)
        for rank, positions in enumerate(held):
            assert positions.tolist() == [*range(rank * chunk, (rank + 1) * chunk),
                                          *range((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)]
        # Causal work is balanced: every rank's queries see the same number of keys in total.
        assert len({int((positions + 1).sum()) for positions in held}) == 1


def test_split_batch_cuts_by_position_and_keeps_key_masks_whole_in_ring_order():
    batch = {"input_ids": torch.arange(16).repeat(2, 1), "labels": torch.arange(16).repeat(2, 1) + 100,
             "attention_mask": torch.arange(16).repeat(2, 1) + 200, "sentence_order_label": torch.tensor([0, 1])}
    inputs = SequenceInputs(split=("input_ids", "labels"), key_masks=("attention_mask",))
    part = split_batch(batch, inputs, 2, 1)
    assert part["input_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert part["labels"][0].tolist() == [104, 105, 106, 107, 108, 109, 110, 111]
    assert part["position_ids"][1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert (part["attention_mask"][0] - 200).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(part["sentence_order_label"], batch["sentence_order_label"])
    without_types = split_batch({"input_ids": batch["input_ids"], "labels": batch["labels"]},
                                BERT(BERT_CONFIG).sequence_inputs(), 2, 1)  # BERT's token types are optional
    assert without_types["input_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11] and "token_type_ids" not in without_types
    restarting = {**batch, "position_ids": torch.arange(16).repeat(2, 1) % 5}  # cut too, not replaced
    assert split_batch(restarting, inputs, 2, 1)["position_ids"][0].tolist() == [4, 0, 1, 2, 3, 4, 0, 1]


def test_split_batch_refuses_what_it_cannot_cut():
    inputs = GPT(replace(gpt_setup.CONFIG, max_seq_length=32)).sequence_inputs()
    with pytest.raises(ValueError, match=r"Sequence length 40 exceeds max_seq_length=32 of GPT"):  # a rank sees 10
        long = torch.zeros(2, 40, dtype=torch.long)
        split_batch({"input_ids": long, "labels": long}, inputs, 4, 0, model_name="GPT")
    ids = torch.zeros(2, 20, dtype=torch.long)
    with pytest.raises(ValueError, match=r"multiple of 8; it is 20. Use seq_length=16 or 24"):
        split_batch({"input_ids": ids, "labels": ids}, inputs, 4, 0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 by sequence parallelism.*multiple of 16; it is 20"):
        split_batch({"input_ids": ids, "labels": ids}, inputs, 4, 0, tensor_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"'loss_mask' \(shape \[2, 20\]\) has the sequence dimension, but GPT"):
        split_batch({"input_ids": ids, "labels": ids, "loss_mask": ids}, inputs, 2, 0, model_name="GPT")
    documents = torch.arange(16).repeat(2, 1) // 5  # kept whole in the ring's order, as key masks are
    part = split_batch({"input_ids": ids[:, :16], "labels": ids[:, :16], "document_ids": documents}, inputs, 2, 1)
    assert part["document_ids"][0].tolist() == [0, 0, 0, 0, 2, 2, 2, 3, 0, 1, 1, 1, 1, 1, 2, 2]

def _state(**sizes) -> ParallelState:
    return ParallelState(config=ParallelConfig(**sizes), device=torch.device("cpu"))  # no groups: nothing to wait in


def test_models_the_split_attention_cannot_serve_are_refused_before_anything_runs():
    state = _state(context_parallel_size=2)
    with pytest.raises(ValueError, match=r"define sequence_inputs\(\)"):
        BatchSplitter(torch.nn.Linear(2, 2), state)
    with pytest.raises(ValueError, match=r"offering the hook .*CoreAttention.*: Sequential has none"):
        apply_context_parallel(torch.nn.Sequential(torch.nn.Linear(2, 2)), state)
    dropping = GPT(replace(gpt_setup.CONFIG, attention_dropout=0.1))
    dropping.configure_model()
    with pytest.raises(ValueError, match=r"attention dropout.*model.blocks.0.attn.core_attention, attention_dropout=0.1"):
        apply_context_parallel(dropping, state)
    with pytest.raises(ValueError, match=r"sentence-order head .* BERTConfig\(binary_head=False\)"):
        BERT(BERTConfig(max_seq_length=16, hidden_size=32, num_layers=2, num_heads=4)).validate_parallel_config(
            state.config)
    capped = GPT(replace(gpt_setup.CONFIG, attn_logit_softcapping=30.0))
    capped.configure_model()
    with pytest.raises(ValueError, match=r"soft-capped attention scores.*model.blocks.0.attn.core_attention, softcap=30.0"):
        apply_context_parallel(capped, state)
    with pytest.raises(ValueError, match=r"Mixture-of-Experts model is not supported"):
        GPT(gpt_setup.CONFIGS["moe"]).validate_parallel_config(state.config)


def _reference(name):
    """One process, the whole global batch, torch's own clipping: what every layout must give."""
    torch.manual_seed(gpt_setup.SEED)
    module = MODELS[name]()
    module.configure_model()
    model = module.model
    opt = (bert_setup if name == "bert" else gpt_setup).optimizer(model.parameters())
    losses = []
    for batch in model_batches(name):
        loss_sum, tokens = model_loss(model, batch)
        loss = loss_sum / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), gpt_setup.CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_layouts")
    results, _ = run_job("cp_layouts", 4, out, ",".join(LAYOUTS + list(FP8_LAYOUTS) + COUNTS + EXTRAS))
    return out, results


@pytest.fixture(scope="module")
def fp8_single(tmp_path_factory):
    """The fp8 references: one process (cp1), the worker's own model and batches."""
    out = tmp_path_factory.mktemp("cp_fp8_single")
    references = sorted(set(FP8_LAYOUTS.values()))
    run_job("cp_layouts", 1, out, ",".join(references))
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in references}


@pytest.fixture(scope="module")
def references():
    return {name: _reference(name) for name in MODELS if name != "chunk"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_parallel_layouts_match_one_process(launched, references, layout):
    out, _ = launched
    ref_losses, ref_weights = references[layout.split("-")[0].replace("chunk", "gpt")]
    assert len(ref_losses) == gpt_setup.STEPS
    _deviations(torch.load(out / f"{layout}.pt", weights_only=True), ref_losses, ref_weights, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(FP8_LAYOUTS))
def test_fp8_under_context_parallelism_matches_one_process_in_fp8(launched, fp8_single, layout):
    out, _ = launched
    single = fp8_single[FP8_LAYOUTS[layout]]
    assert len(single["losses"]) == 1
    _deviations(torch.load(out / f"{layout}.pt", weights_only=True), single["losses"], single["weights"], layout)


def test_the_reference_batches_are_padded_and_the_sequence_long_enough_to_cut_four_ways():
    assert not BERT_CONFIG.binary_head
    assert (model_batches("bert")[0]["attention_mask"] == 0).any()  # so the key masks are exercised
    assert gpt_setup.SEQ % (2 * 4) == 0


@pytest.mark.slow
def test_ring_and_all_gather_attention_equal_sdpa_in_fp64(launched):
    _, results = launched
    for layout in ("kernels-gpt-cp4-tp1-dp1", "kernels-gpt-cp2-tp1-dp2"):
        for rank, result in enumerate(results):
            worst = result[layout]
            # both attentions x causal / bidirectional / padded / documents / documents in a window / the same with
            # sinks x MHA / GQA / MQA
            assert len(worst) == 2 * 6 * 3
            assert max(worst.values()) < 1e-12, (layout, rank, worst)


@pytest.mark.slow
def test_the_ring_sends_keys_and_values_round_once_forward_and_their_gradients_home_backward(launched):
    _, results = launched
    layers = gpt_setup.CONFIG.num_layers
    for layout, cp in (("count-gpt-cp4-tp1-dp1", 4), ("count-llama-cp2-tp1-dp2", 2)):
        for rank, result in enumerate(results):
            # Forward: K and V passed cp - 1 times: 2 (cp - 1) sends and receives per attention layer, nothing else.
            assert result[layout]["forward"] == {"send/cp": 2 * (cp - 1) * layers, "recv/cp": 2 * (cp - 1) * layers}
            # Backward: K and V round again (2 (cp - 1)), and dK, dV cp hops, the last one home (2 cp).
            assert result[layout]["backward"] == {"send/cp": (4 * cp - 2) * layers, "recv/cp": (4 * cp - 2) * layers}
    for rank, result in enumerate(results):  # BERT under tp + sequence parallelism: the ring besides tp's own
        counted = result["count-bert-cp2-tp2-dp1-sp"]
        layers = BERT_CONFIG.num_layers
        assert counted["forward"]["send/cp"] == 2 * layers and counted["backward"]["send/cp"] == 6 * layers
        assert {key.split("/")[1] for key in counted["forward"]} == {"cp", "tp"}
        # The all-gather attention: one all-gather of K and one of V per layer, reduce-scatters of their gradients.
        gathered = result["count-llama-cp4-tp1-dp1-ag"]
        layers = gpt_setup.LLAMA_CONFIG.num_layers
        assert gathered["forward"] == {"all_gather_single/cp": 2 * layers}
        assert gathered["backward"] == {"reduce_scatter_single/cp": 2 * layers}


@pytest.mark.slow
def test_generation_under_context_parallelism_gives_the_tokens_of_one_process(launched):
    _, results = launched
    for result in results:
        generated = result["gen-llama-cp2-tp2-dp1-sp"]
        assert generated["got"] == generated["expected"]


@pytest.mark.slow
def test_every_rank_refuses_bad_input_with_the_numbers_and_the_fix(launched):
    _, results = launched
    said = [result["errors-gpt-cp4-tp1-dp1"] for result in results]
    assert all(s == said[0] for s in said)  # the same message on every rank
    assert "multiple of 8; it is 12" in said[0]["length"]
    assert "CoreAttention" in said[0]["attention"]


@pytest.mark.parametrize("causal, padded", [(True, False), (False, False), (False, True)])
def test_a_block_on_the_cuda_back_end_equals_the_cpu_kernel_and_sdpa(causal, padded):
    """The CUDA back end (FlexAttention, run eagerly here) and torch's CPU flash kernel give one block's output,
    log-sum-exp and gradients alike, and SDPA's; a query whose keys are all padding gets 0 and -inf, never NaN."""
    from lightning_megatron.context_parallel.kernels import CPU_FLASH, FLEX_EAGER
    from lightning_megatron.context_parallel.masks import BlockPattern

    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 12, 8, generator=generator, dtype=torch.float64) for _ in range(4))
    keys = torch.ones(2, 12, dtype=torch.bool)
    if padded:
        keys[1] = False  # the second sample's keys all padding in this block
    pattern = BlockPattern(q_pos=torch.arange(12), k_pos=torch.arange(12), causal=causal, triangle=causal,
                           k_keep=keys if padded else None)
    results = {}
    for name, backend in (("cpu", CPU_FLASH), ("flex", FLEX_EAGER)):
        (_, out, lse), = backend.forward(q, k, v, pattern)
        (_, _, *grads), = backend.backward(grad, q, k, v, out, lse, pattern)
        results[name] = (out, lse, *grads)
    for a, b in zip(results["cpu"], results["flex"]):
        assert torch.allclose(a, b, atol=1e-12, equal_nan=False), (a - b).abs().max()
    out, lse = results["flex"][:2]
    assert torch.isfinite(out).all()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=causal)
    (expected * grad).sum().backward()
    rows = slice(0, 1) if padded else slice(0, 2)  # the fully padded sample's SDPA output is NaN
    assert torch.allclose(out[rows], expected[rows], atol=1e-12)
    if padded:
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()
    else:
        for mine, theirs in zip(results["flex"][2:], (t.grad for t in full)):
            assert torch.allclose(mine, theirs, atol=1e-12)
