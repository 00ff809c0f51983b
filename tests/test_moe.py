"""Mixture of Experts and expert parallelism: the layer's pieces in one process, then the layout matrix (every
expert-parallel layout against one process) and the collectives of one step, in one 4-rank launch."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from launch import run_job
from workers.gpt_setup import CLIP, MOE, SEED, batches, optimizer
from workers.gpt_setup import MOE_CONFIGS as CONFIGS
from lightning_megatron.models import GPT, GPTConfig, GPTModel
from lightning_megatron.models.moe import MoEConfig, capacity_mask, update_expert_biases
from lightning_megatron.models.router import TopKRouter
from lightning_megatron.parallel import ParallelConfig

# <variant>-ep{E}[-pp{P}]-tp{T}-dp{D}[-sp][-mb{M}][-z{Z}][-og][-rc][-zb][-etp1] on 4 ranks (tests/workers/moe_layouts.py).
LAYOUTS = [
    "moe-ep2-tp1-dp4",            # 2 replicas of each expert: expert gradients summed over the expert-data-parallel group
    "moe-ep4-tp1-dp4",            # one expert per rank
    "moe-ep2-tp2-dp2",            # experts split over tp inside one region
    "moe-ep2-tp2-dp2-sp-mb2-rc",  # ... with sequence parallelism, two micro-batches and full recomputation
    "moe-ep2-pp2-tp1-dp2-mb2",    # auxiliary losses attached on both stages (one of whose layers is dense)
    "moe-ep2-tp1-dp4-z1",         # ZeRO-1 sharded over each group
    "moe-ep4-tp1-dp4-mb2-z2",     # ZeRO-2, expert buckets over a group of one
    "moe-ep2-tp1-dp4-z1-og",      # ZeRO-1 with the parameter all-gathers (dp; experts: expert-dp) overlapped
    "cap-ep2-tp1-dp4",            # capacity factor: the same tokens dropped
    "cap-ep2-tp2-dp2-sp",
    "bias-ep4-tp1-dp4",           # sigmoid scores, aux-loss-free expert bias moved by the global batch's loads
    "bias-ep2-pp2-tp1-dp2-mb2-rc",  # recomputed MoE layers replay their all-to-alls, counted once
    "bias-ep2-pp2-tp1-dp2-mb2-rc-zb",  # ... under the zero-bubble schedule: aux losses through its weight pass
    "plain-ep2-tp2-dp2-z1",       # Qwen2-MoE's routing (no renormalisation), no shared expert
    "mla-ep2-tp2-dp2",            # DeepSeek-V3-shaped: latent attention split by heads, its latents entering tp once
    "mla-ep2-tp2-dp2-sp-mb2",     # ... gathered along the sequence once
    "mla-ep2-pp2-tp1-dp2-mb2",    # ... over two pipeline stages (the dense first layer and an MoE one on stage 0)
    "moe-ep2-tp1-dp4-z3",         # ZeRO-3: experts sharded over their expert-data-parallel group (2), the rest over dp
    "moe-ep2-tp2-dp2-sp-mb2-z3",  # ... over a group of one, tp-split experts, partial norms summed over tp
    "moe-ep2-tp2-dp2-etp1",       # whole experts on each tp rank: the tp pair is the expert-parallel group
    "cap-ep4-tp2-dp2-sp-z1-etp1",  # ... ep over tp x dp, sequence parallel, dropped assignments, ZeRO-1 over edp 1
    "moe-ep2-tp2-dp2-sp-z3-etp1",  # ... ZeRO-3: whole experts' rows over their edp pair (tp x dp / ep)
    "qwen3moe-ep2-tp2-dp2",       # Qwen3-MoE: q/k norms on each rank's heads, experts split over tp and ep
    "qwen3moe-ep2-pp2-tp1-dp2-mb2",  # ... over two stages, the dense layer on the second
    "oss-ep2-pp2-tp1-dp2-mb2",    # GPT-OSS's pieces: sinks, attention/router/expert biases, clamped SwiGLU, YaRN, windows
    "mla-ep2-tp1-dp4-z3",         # DeepSeek-V3-shaped under ZeRO-3: experts over their edp pair, latents over dp4
    "mla-ep2-tp2-dp2-sp-z3-etp1",  # ... whole experts on each tp rank, latent attention split by heads, SP
    "oss-ep2-tp2-dp2",            # ... sinks split with the heads, the experts' down-projection biases added once after tp
    "oss-ep2-tp2-dp2-sp-mb2",     # ... added to each rank's sequence chunk, their gradients summed over tp
    "oss-ep2-tp1-dp4-z3",         # ... ZeRO-3 with ep2
    "oss-ep2-tp2-dp2-z3",         # ... at tp2: the replicated down-projection biases counted once in the norm
]
COUNTS = ["count-ep2-tp1-dp4", "count-ep2-tp2-dp2", "count-ep2-tp2-dp2-sp"]
GENERATION = ["gen-ep2-tp1-dp4", "gen-ep2-pp2-tp1-dp2", "gen-ep2-tp2-dp2-sp"]
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-5


@functools.cache
def _reference(name):
    """Plain PyTorch, one process, the whole global batch, torch's own clipping (what every layout must give); once
    per variant (the layouts of a variant only read it)."""
    torch.manual_seed(SEED)
    config = CONFIGS[name]
    model = GPTModel(config)
    opt = optimizer(model.parameters())
    losses = []
    for input_ids, labels in batches():
        loss_sum, tokens = model.loss(input_ids, labels)
        loss = loss_sum / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        if config.moe.expert_bias:
            update_expert_biases(model, config.moe.expert_bias_update_rate)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_layouts")
    results, _ = run_job("moe_layouts", 4, out, ",".join(LAYOUTS + COUNTS + GENERATION))
    return out, results


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_layouts_match_one_process(launched, layout):
    out, _ = launched
    name = layout.split("-")[0]
    ref_losses, ref_weights = _reference(name)
    result = torch.load(out / f"{layout}.pt", weights_only=True)
    assert len(result["losses"]) == len(ref_losses)
    loss_dev = max(abs(a - b) for a, b in zip(result["losses"], ref_losses))
    assert loss_dev < LOSS_TOL, f"{layout}: losses {result['losses']} vs reference {ref_losses}"
    assert result["weights"].keys() == ref_weights.keys()  # every expert, under its global index
    weight_dev = {k: (result["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights}
    worst = max(weight_dev, key=weight_dev.get)
    print(f"{layout}: loss deviation {loss_dev:.2e}, worst weight deviation {weight_dev[worst]:.2e} ({worst})")
    assert weight_dev[worst] < WEIGHT_TOL, f"{layout}: {worst} deviates by {weight_dev[worst]:.2e}"
    if name in ("bias", "mla"):  # the bias moved (and alike at every layout): the check above covers its values
        first = CONFIGS[name].moe.moe_layers(CONFIGS[name].num_layers)[0]
        assert ref_weights[f"blocks.{first}.mlp.router.expert_bias"].abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("variant, architecture", [("qwen3moe", "Qwen3MoeForCausalLM"), ("oss", "GptOssForCausalLM"),
                                                   ("mla", "DeepseekV3ForCausalLM")], ids=["qwen3moe", "gpt_oss", "deepseek"])
def test_moe_layouts_start_from_the_loss_of_transformers_model(launched, tmp_path, variant, architecture):
    """The first step's loss at each Qwen3-MoE (GPT-OSS, DeepSeek-V3-shaped) layout is that of transformers'
    Qwen3MoeForCausalLM (GptOssForCausalLM, DeepseekV3ForCausalLM) loaded from the same initial weights (exported by
    its family), on the same batch (the auxiliary losses only add to the gradients, as transformers' do with
    output_router_logits off)."""
    transformers = pytest.importorskip("transformers")
    out, _ = launched
    torch.manual_seed(SEED)
    initial = GPT(CONFIGS[variant])
    initial.configure_model()
    initial.to_hf(tmp_path)
    hf = getattr(transformers, architecture).from_pretrained(tmp_path).eval()
    input_ids, labels = batches()[0]
    with torch.no_grad():
        expected = F.cross_entropy(hf(input_ids).logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()
    for layout in (layout for layout in LAYOUTS if layout.startswith(f"{variant}-")):
        first = torch.load(out / f"{layout}.pt", weights_only=True)["losses"][0]
        assert abs(first - expected) < LOSS_TOL, (layout, first, expected)


@pytest.mark.slow
@pytest.mark.parametrize("layout", COUNTS)
def test_each_moe_layer_does_two_all_to_alls_each_way(launched, layout):
    """On the expert-parallel group: per MoE layer 2 all-to-alls forward (dispatch, combine) and 2 backward, plus
    the counts' all-gather (``E`` integers) forward that an uneven all-to-all needs; nothing else, on any rank."""
    _, results = launched
    moe_layers = len(MOE.moe_layers(CONFIGS["moe"].num_layers))
    sp, tp = layout.endswith("-sp"), "tp2" in layout
    for rank_results in results:
        calls = rank_results[layout]["collectives"]
        on_ep = {phase: {k: v for k, v in calls[phase].items() if k.endswith("/ep")} for phase in calls}
        assert on_ep["forward"] == {"all_to_all_single/ep": 2 * moe_layers, "all_gather_single/ep": moe_layers}
        assert on_ep["backward"] == {"all_to_all_single/ep": 2 * moe_layers}
        assert not any(k.endswith(("/dp", "/expert-dp", "/world")) for phase in calls for k in calls[phase]), calls
        if not tp:
            assert set(calls["forward"]) == set(on_ep["forward"]) and set(calls["backward"]) == set(on_ep["backward"])
            continue
        # What tp adds is what a dense layer's MLP adds, once per MoE layer (entering and leaving the experts'
        # region) and once per shared expert, plus the combine weights' gradient entering with the tokens.
        layers, dense, shared = CONFIGS["moe"].num_layers, layers_dense(), moe_layers
        embedding_and_loss = 1 + 3  # vocab-parallel embedding; cross-entropy's max, sum and target logit
        if not sp:
            assert calls["forward"]["all_reduce/tp"] == layers + dense + moe_layers + shared + embedding_and_loss
            # f of attention, dense MLPs, shared experts, the experts' tokens and their combine weights; the head's f
            assert calls["backward"]["all_reduce/tp"] == layers + dense + shared + 2 * moe_layers + 1
        else:
            # Entering: tokens, weights and expert ids gathered along the sequence; leaving: one reduce-scatter.
            gathers = layers + dense + shared + 3 * moe_layers + 1  # + the head's gather
            assert calls["forward"]["all_gather_single/tp"] == gathers
            assert calls["forward"]["reduce_scatter_single/tp"] == layers + dense + shared + moe_layers
            assert calls["backward"]["reduce_scatter_single/tp"] == gathers - moe_layers  # ids have no gradient


@pytest.mark.slow
@pytest.mark.parametrize("layout", COUNTS)
def test_each_moe_layer_reads_its_split_sizes_on_the_host_once(launched, layout):
    """The uneven all-to-all takes Python split sizes: one read of the exchanged counts per MoE layer in forward,
    at one place (the dispatcher), whatever tp and sequence parallelism do; none in backward (it reuses them)."""
    _, results = launched
    moe_layers = len(MOE.moe_layers(CONFIGS["moe"].num_layers))
    for rank_results in results:
        syncs = rank_results[layout]["host_syncs"]
        assert syncs["backward"] == {}, syncs
        assert len(syncs["forward"]) == 1 and list(syncs["forward"].values()) == [moe_layers], syncs
        site, = syncs["forward"]
        assert site.startswith("tolist lightning_megatron/expert_parallel/dispatcher.py:"), site


@pytest.mark.slow
@pytest.mark.parametrize("layout", GENERATION)
def test_generation_under_expert_parallelism_matches_one_process(launched, layout):
    """Each dp rank generates its own prompts; dp rank 0's batch ends at its first token, yet every rank keeps
    stepping until all of its expert-parallel group are done (else the all-to-alls would hang)."""
    _, results = launched
    for rank_results in results:
        assert rank_results[layout]["got"] == rank_results[layout]["expected"]
    assert [len(tokens) for tokens in results[0][layout]["expected"]] == [4]  # rank 0's batch stopped at once


def layers_dense():
    config = CONFIGS["moe"]
    return config.num_layers - len(config.moe.moe_layers(config.num_layers))


# ---------------------------------------------------------------------------------------------- one process
def _tiny(**moe):
    return GPTConfig.from_name("llama-tiny", hidden_size=32, num_heads=4, num_query_groups=2, num_layers=2,
                               max_seq_length=16, moe=MoEConfig(**{"num_experts": 4, "top_k": 2, **moe}))


def test_reported_loss_is_the_language_model_loss_and_the_aux_gradient_is_the_formula():
    """The balance and z-losses change the gradient by exactly coeff x their formulas' gradients (written out here
    from the definitions), and never the loss that is reported."""
    torch.manual_seed(0)
    ids = torch.randint(0, 257, (3, 16))
    grads, losses, inputs = {}, {}, {}
    for coeffs in ((0.0, 0.0), (0.1, 0.01)):
        torch.manual_seed(1)
        model = GPTModel(_tiny(aux_loss_coeff=coeffs[0], z_loss_coeff=coeffs[1]))
        router = model.blocks["1"].mlp.router
        router.register_forward_hook(lambda m, args, out: inputs.__setitem__(coeffs, args[0].detach()))
        loss_sum, tokens = model.loss(ids, ids)
        (loss_sum / tokens).backward()
        grads[coeffs], losses[coeffs] = router.weight.grad.clone(), loss_sum.item()
    assert losses[(0.0, 0.0)] == losses[(0.1, 0.01)]
    torch.manual_seed(1)
    weight = GPTModel(_tiny()).blocks["1"].mlp.router.weight.detach().clone().requires_grad_()
    x = inputs[(0.1, 0.01)]
    logits = x @ weight.t()
    probs = logits.softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    counts = torch.nn.functional.one_hot(chosen, 4).sum(dim=(1, 2)).float()  # [B, E] per sequence
    seq = ids.shape[1]
    balance = sum(4 / (seq * seq * 2) * (counts[b] * probs[b].sum(0)).sum() for b in range(3))
    z = torch.logsumexp(logits, -1).pow(2).sum()
    (0.1 * seq * balance + 0.01 * z).backward()
    expected = weight.grad / (3 * seq)  # the token-sum units are divided by the tokens, as the loss is
    torch.testing.assert_close(grads[(0.1, 0.01)] - grads[(0.0, 0.0)], expected, atol=1e-7, rtol=1e-4)


def test_statistics_of_uniform_routing():
    torch.manual_seed(0)
    model = GPTModel(_tiny())
    for name, param in model.named_parameters():
        if name.endswith("router.weight"):
            param.data.zero_()  # every expert scores 1/E: the balance value is 1 whatever is chosen
    ids = torch.randint(0, 257, (2, 16))
    model.loss(ids, ids)
    balance, z, max_load = model.moe_aux_losses.statistics()
    assert balance.item() == pytest.approx(1.0, abs=1e-6)
    assert max_load.item() == pytest.approx(2.0)  # every token picks the first 2 of the 4 tied experts
    assert z.item() == pytest.approx(math.log(4) ** 2, rel=1e-5)  # logsumexp of E zeros
    assert model.moe_aux_losses.statistics().tolist() == [0.0, 0.0, 0.0]  # read once: nothing recorded since


def test_capacity_keeps_the_highest_weights_per_sequence_and_expert():
    torch.manual_seed(0)
    ids = torch.randint(0, 4, (3, 20, 2))
    weights = torch.rand(3, 20, 2)
    keep = capacity_mask(ids, weights, 4, capacity=3)
    for b in range(3):
        for e in range(4):
            chosen = ids[b] == e
            kept = keep[b] & chosen
            assert kept.sum() == min(3, chosen.sum())
            if chosen.sum() > 3:  # the kept ones are the highest weights of this expert in this sequence
                assert weights[b][kept].min() >= weights[b][chosen & ~keep[b]].max()
    assert capacity_mask(ids, weights, 4, capacity=40).all()


def test_an_expert_that_gets_no_tokens_still_has_a_zero_gradient():
    """Every local expert runs (on an empty batch if need be), so bucketed gradient hooks always complete."""
    torch.manual_seed(0)
    model = GPTModel(_tiny())
    def never_expert_3(module, args, routing):
        return routing._replace(expert_ids=routing.expert_ids.clamp(max=2))

    for block in model.blocks.values():
        block.mlp.router.register_forward_hook(never_expert_3)
    ids = torch.randint(0, 257, (2, 16))
    loss_sum, tokens = model.loss(ids, ids)
    loss_sum.backward()
    for block in model.blocks.values():
        grad = block.mlp.experts["3"].fc.weight.grad
        assert grad is not None and torch.count_nonzero(grad) == 0
        assert torch.count_nonzero(block.mlp.experts["0"].fc.weight.grad) > 0


def test_expert_bias_moves_toward_equal_loads():
    router = TopKRouter(8, 4, 2, expert_bias=True)
    router.initialize_buffers()
    router.update_expert_bias(torch.tensor([10, 0, 5, 5]), rate=0.1)
    assert router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    assert "expert_bias" in router.state_dict() and "tokens_per_expert" not in router.state_dict()
    router.to(torch.bfloat16)  # bf16-true: the weight is cast, the bias stays fp32 (a 1e-3 step on 0.1 needs it)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    router.update_expert_bias(torch.tensor([0, 5, 5, 10]), rate=1e-3)
    assert router.expert_bias.tolist() == pytest.approx([-0.099, 0.1, 0.0, -0.001], abs=1e-7)


def test_sigmoid_routing_normalises_the_chosen_scores():
    router = TopKRouter(8, 4, 2, score_function="sigmoid")
    torch.nn.init.normal_(router.weight)
    x = torch.randn(2, 3, 8)
    routing = router(x)
    scores = torch.sigmoid(x @ router.weight.t())
    top = scores.topk(2, dim=-1)
    torch.testing.assert_close(routing.weights, top.values / top.values.sum(-1, keepdim=True))
    assert torch.equal(routing.expert_ids, top.indices)


def test_parameter_counts():
    config = CONFIGS["moe"]
    model = GPTModel(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for p in model.blocks["0"].mlp.experts["0"].parameters())
    assert config.num_parameters() - config.num_active_parameters() == 3 * (4 - 2) * expert


@pytest.mark.parametrize("sizes, message", [
    (dict(data_parallel_size=4, expert_parallel_size=3), "must divide data_parallel_size=4"),
    (dict(tensor_parallel_size=4, expert_tensor_parallel_size=2), "expert_tensor_parallel_size=2 with tensor_parallel"),
    (dict(tensor_parallel_size=2, expert_tensor_parallel_size=1), "must hold different experts"),
    (dict(tensor_parallel_size=2, data_parallel_size=3, expert_parallel_size=4, expert_tensor_parallel_size=1),
     r"must divide tensor_parallel_size x data_parallel_size = 6"),
])
def test_bad_expert_layouts_are_refused(sizes, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**sizes)


@pytest.mark.parametrize("config, sizes, message", [
    (GPTConfig.from_name("llama-tiny"), (1, 2), "has moe=None"),
    (_tiny(), (1, 3), "does not divide num_experts=4"),
    (_tiny(ffn_hidden_size=30), (4, 1), r"does not divide MoEConfig.ffn_hidden_size=30"),
])
def test_the_model_refuses_layouts_its_experts_cannot_take(config, sizes, message):
    tp, ep = sizes
    with pytest.raises(ValueError, match=message):
        GPT(config).validate_parallel_config(ParallelConfig(tensor_parallel_size=tp, data_parallel_size=ep,
                                                            expert_parallel_size=ep))


def test_generation_with_experts_matches_the_full_forward():
    """Greedy generation with the key/value cache routes each new token as the whole-sequence forward does."""
    torch.manual_seed(0)
    gpt = GPT(_tiny(shared_expert_size=32, shared_expert_gate=True))
    gpt.configure_model()
    gpt.eval()
    prompt = torch.randint(0, 257, (2, 5))
    out = gpt.generate(prompt, max_new_tokens=6)
    tokens = prompt
    with torch.no_grad():
        for _ in range(6):
            tokens = torch.cat([tokens, gpt.model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens)
