"""The routed experts as grouped GEMMs or as a loop (``models/experts.py``), and the MoE layer's host syncs: none
with the experts on one process, whatever the number of layers and experts."""

import pytest
import torch
from torch import nn

from lightning_megatron.models import GPTConfig, GPTModel, experts as experts_module
from lightning_megatron.models.experts import grouped_experts, grouped_gemm_supported, looped_experts
from lightning_megatron.models.mlp import build_mlp
from lightning_megatron.models.moe import MoEConfig, update_expert_biases
from lightning_megatron.parallel.guards import count_host_syncs

HIDDEN, FFN = 16, 24


def _experts(activation: str, number: int = 4, bias: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    experts = [build_mlp(activation, HIDDEN, FFN, bias=bias) for _ in range(number)]
    with torch.no_grad():
        for expert in experts:
            for layer in (expert.fc, expert.proj):
                if layer.bias is not None:
                    layer.bias.normal_()
    return experts


def _grads(fn, experts, tokens, counts, upstream):
    """Output and gradients (tokens, then every expert weight) of ``fn``; ``upstream`` is zero on uncounted rows,
    as the MoE layer masks them."""
    tokens = tokens.detach().clone().requires_grad_()
    out = fn(experts, tokens, counts)
    weights = [p for e in experts for p in e.parameters()]
    grads = torch.autograd.grad(out, [tokens, *weights], upstream)
    return out, grads


@pytest.mark.parametrize("activation,bias", [("gelu", False), ("swiglu", False), ("clamped_swiglu", True)])
@pytest.mark.parametrize("counts, extra_rows", [([3, 0, 5, 2], 0), ([0, 0, 7, 0], 3), ([0, 0, 0, 0], 2)])
def test_grouped_and_looped_experts_agree_forward_and_backward(activation, bias, counts, extra_rows):
    """Empty experts, and rows past the counted ones (dropped assignments): the counted rows' outputs and every
    gradient are the loop's; the experts that got no token get zero gradients. With biases (GPT-OSS's experts) too."""
    experts = _experts(activation, bias=bias)
    counts = torch.tensor(counts)
    rows = int(counts.sum()) + extra_rows
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randn(rows, HIDDEN, generator=generator)
    upstream = torch.randn(rows, HIDDEN, generator=generator)
    upstream[int(counts.sum()):] = 0
    counted = slice(0, int(counts.sum()))
    grouped_out, grouped = _grads(grouped_experts, experts, tokens, counts, upstream)
    loop_out, loop = _grads(looped_experts, experts, tokens, counts, upstream)
    torch.testing.assert_close(grouped_out[counted], loop_out[counted], rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(loop_out[int(counts.sum()):]) == 0
    torch.testing.assert_close(grouped[0][counted], loop[0][counted], rtol=1e-6, atol=1e-6)
    for g, l in zip(grouped[1:], loop[1:]):
        torch.testing.assert_close(g, l, rtol=1e-6, atol=1e-6)
    per_expert = len(list(experts[0].parameters()))
    for index, n in enumerate(counts.tolist()):
        if n == 0:  # every parameter of an expert that got no token
            assert all(torch.count_nonzero(g) == 0 for g in grouped[1 + per_expert * index:1 + per_expert * (index + 1)])


def test_grouped_experts_take_any_gradient_layout():
    """``out.sum()`` hands back an expanded ``[0, 0]``-strided gradient, which ``_grouped_mm``'s backward refuses."""
    experts = _experts("swiglu")
    tokens = torch.randn(6, HIDDEN, requires_grad=True)
    grouped_experts(experts, tokens, torch.tensor([2, 0, 3, 1])).sum().backward()
    expected = tokens.detach().clone().requires_grad_()
    looped_experts(experts, expected, torch.tensor([2, 0, 3, 1])).sum().backward()
    torch.testing.assert_close(tokens.grad, expected.grad, rtol=1e-6, atol=1e-6)


def test_grouped_experts_keep_no_stacked_copy_of_the_weights_for_backward():
    """What backward keeps: the tokens, the offsets, the activations and the weights themselves (as the loop's
    ``F.linear`` keeps them), never an ``[E, out, in]`` stack of them (a second copy per layer in flight)."""
    experts = _experts("swiglu")
    weights = {p.data_ptr() for e in experts for p in e.parameters()}
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    tokens = torch.randn(10, HIDDEN, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        grouped_experts(experts, tokens, torch.tensor([3, 0, 5, 2]))
    copies = [tuple(t.shape) for t in saved if t.dim() == 3 or (t.dim() == 2 and t.data_ptr() not in weights
                                                                 and t.shape in ((2 * FFN, HIDDEN), (HIDDEN, FFN)))]
    assert not copies, copies
    assert weights <= {t.data_ptr() for t in saved}


def test_frozen_experts_pass_the_tokens_gradient_alone():
    """Experts whose weights do not train (a model fine-tuned elsewhere): no weight gradients, the same input's."""
    experts = _experts("gelu")
    for p in (p for e in experts for p in e.parameters()):
        p.requires_grad_(False)
    tokens = torch.randn(10, HIDDEN)
    upstream = torch.randn(10, HIDDEN)
    grads = []
    for fn in (grouped_experts, looped_experts):
        x = tokens.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(experts, x, torch.tensor([3, 0, 5, 2])), x, upstream)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-6)
    assert all(p.grad is None for e in experts for p in e.parameters())


def test_grouped_gemms_run_only_where_they_give_the_loops_numbers():
    experts = _experts("swiglu")
    tokens = torch.randn(4, HIDDEN)
    assert grouped_gemm_supported(experts, tokens)  # CPU, fp32
    assert not grouped_gemm_supported([e.double() for e in _experts("swiglu")], tokens.double())  # no fp64 kernel
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU bf16: the loop (its numbers are F.linear's)
        assert not grouped_gemm_supported(experts, tokens)
    biased = [build_mlp("gelu", HIDDEN, FFN, bias=True) for _ in range(2)]
    assert grouped_gemm_supported(biased, tokens)  # a bias per expert, added by row
    assert not grouped_gemm_supported([*biased, *_experts("gelu", 1)], tokens)
    adapted = _experts("gelu", 2)
    adapted[1].proj.lora_a = nn.Linear(FFN, 2, bias=False)  # an adapted layer runs its own forward
    assert not grouped_gemm_supported(adapted, tokens)
    mixed = [*_experts("gelu", 1), *_experts("swiglu", 1)]
    assert not grouped_gemm_supported(mixed, tokens)


def _moe_gpt(layers: int, experts: int, **moe) -> GPTModel:
    torch.manual_seed(0)
    config = GPTConfig.from_name("llama-tiny", hidden_size=32, num_heads=4, num_query_groups=2, num_layers=layers,
                                 max_seq_length=16, vocab_size=257,
                                 moe=MoEConfig(num_experts=experts, top_k=2, ffn_hidden_size=32, aux_loss_coeff=1e-2,
                                               z_loss_coeff=1e-3, **moe))
    return GPTModel(config)


# Dropless with DeepSeek-V3's expert bias (and its update) and a gated shared expert; a capacity that drops.
VARIANTS = {"dropless": {"score_function": "sigmoid", "expert_bias": True, "shared_expert_size": 32,
                         "shared_expert_gate": True},
            "capacity": {"capacity_factor": 1.0}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_moe_layers_never_sync_the_host(variant):
    """A forward and backward with the load-balancing and z-losses (and the expert-bias update, or a capacity) at 2
    and 4 layers, 4 and 8 experts: the same host syncs, none of them in the MoE layers' code."""
    moe_files = ("models/moe.py", "models/router.py", "models/experts.py", "expert_parallel/")
    totals = {}
    for layers, experts in ((2, 4), (4, 4), (2, 8)):
        model = _moe_gpt(layers, experts, **VARIANTS[variant])
        ids = torch.randint(0, 257, (4, 16), generator=torch.Generator().manual_seed(2))
        with count_host_syncs() as syncs:
            loss_sum, _ = model.loss(ids, ids)
            loss_sum.backward()
            if model.config.moe.expert_bias:
                update_expert_biases(model, model.config.moe.expert_bias_update_rate)
        in_moe = [site for sites in syncs.sites.values() for site in sites if any(f in site for f in moe_files)]
        assert not in_moe, syncs.report()
        totals[(layers, experts)] = syncs.total
    assert len(set(totals.values())) == 1, totals


@pytest.fixture
def uninitialised_memory_is_nan():
    """Every ``torch.empty`` filled with NaN: a row a kernel leaves unwritten (a grouped GEMM's rows past its
    groups, in forward and in backward) shows instead of reading as whatever memory held."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.mark.slow
def test_a_moe_model_trains_alike_with_grouped_gemms_and_the_loop(monkeypatch, uninitialised_memory_is_nan):
    """Whole-model losses and gradients, with dropped assignments (capacity) and an expert bias."""
    def step():
        model = _moe_gpt(2, 4, capacity_factor=1.0, score_function="sigmoid", expert_bias=True)
        ids = torch.randint(0, 257, (4, 16), generator=torch.Generator().manual_seed(3))
        loss_sum, _ = model.loss(ids, ids)
        loss_sum.backward()
        return loss_sum.detach(), {name: p.grad for name, p in model.named_parameters()}, model

    grouped_loss, grouped_grads, model = step()
    assert any(grouped_gemm_supported(list(b.mlp.experts.values()), torch.zeros(1, 32)) for b in model.blocks.values())
    monkeypatch.setattr(experts_module, "grouped_gemm_supported", lambda experts, tokens: False)
    loop_loss, loop_grads, _ = step()
    torch.testing.assert_close(grouped_loss, loop_loss, rtol=1e-6, atol=1e-6)
    for name in loop_grads:
        torch.testing.assert_close(grouped_grads[name], loop_grads[name], rtol=1e-6, atol=1e-6, msg=name)


def test_the_gpu_checks_moe_row_passes_its_cpu_self_test():
    """``benchmarks/moe_grouped_check.py`` (a row of the GPU check) runs here in fp32: its plumbing cannot fail there."""
    from benchmarks.moe_grouped_check import moe_device_check

    result = moe_device_check(torch.device("cpu"))
    assert result["status"] == "pass", result
    assert result["numbers"]["worst relative error"] < 1e-6
    assert result["numbers"]["grouped experts host syncs"] == result["numbers"]["moe layer host syncs"] == 0
