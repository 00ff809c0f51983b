"""Gemma 3's pieces outside attention, in one process, against transformers' own modules built here: the
zero-centred RMSNorm, GeGLU, the scaled embedding, a whole decoder layer (sandwich norms; every layer full attention,
no attention soft-capping) and final-logit soft-capping (the head, vocab-parallel padding, the chunked loss).
(tp2 + SP and pp2: tests/workers/layouts.py's "gemma" case.)"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3TextConfig
from transformers.models.gemma3 import modeling_gemma3 as hf

from lightning_megatron.huggingface.mapping import QueryGroups
from lightning_megatron.models import GPTConfig, GPTModel
from lightning_megatron.models.gpt import GPTEmbedding, gpt_layer
from lightning_megatron.models.mlp import GatedMLP
from lightning_megatron.models.norms import ZeroCenteredRMSNorm
from lightning_megatron.tensor_parallel.logits import VocabShard, mark_vocab_parallel, soft_cap

DTYPES = [torch.float32, torch.bfloat16]
GEMMA = GPTConfig(vocab_size=96, max_seq_length=16, hidden_size=48, num_layers=2, num_heads=4, num_query_groups=2,
                  ffn_hidden_size=64, kv_channels=16, normalization="ZeroCenteredRMSNorm", layer_norm_eps=1e-6,
                  position_embedding_type="rope", rotary_base=1e6, activation="geglu", add_bias_linear=False,
                  qk_layernorm=True, norm_position="sandwich", embedding_multiplier=48 ** 0.5,
                  final_logit_softcapping=3.0)


def _hf_config(config: GPTConfig) -> Gemma3TextConfig:
    hf_config = Gemma3TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.query_groups, head_dim=config.head_dim, rms_norm_eps=config.layer_norm_eps,
        query_pre_attn_scalar=config.head_dim, layer_types=["full_attention"] * config.num_layers,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": config.rotary_base},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        attn_logit_softcapping=None, final_logit_softcapping=config.final_logit_softcapping)
    hf_config._attn_implementation = "eager"
    return hf_config


def _randomise(module: torch.nn.Module) -> None:
    """Every parameter random (norm gains too, so that ``1 + w`` differs from ``w`` and from one)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def _layer_state(hf_layer: torch.nn.Module, config: GPTConfig, prefix: str = "") -> dict:
    """Our TransformerLayer's state dict from a Gemma3DecoderLayer's (q/k/v fused by query group)."""
    attn, mlp = hf_layer.self_attn, hf_layer.mlp
    qkv = QueryGroups(config.num_heads, config.query_groups).to_ours(
        [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    state = {"ln_1.weight": hf_layer.input_layernorm.weight, "attn.qkv.weight": qkv,
             "attn.q_norm.weight": attn.q_norm.weight, "attn.k_norm.weight": attn.k_norm.weight,
             "attn.proj.weight": attn.o_proj.weight, "post_attn_norm.weight": hf_layer.post_attention_layernorm.weight,
             "ln_2.weight": hf_layer.pre_feedforward_layernorm.weight,
             "mlp.fc.weight": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
             "mlp.proj.weight": mlp.down_proj.weight,
             "post_mlp_norm.weight": hf_layer.post_feedforward_layernorm.weight}
    return {prefix + name: value.detach() for name, value in state.items()}


def _close(out, ref, tolerance):
    """Within ``tolerance`` of the reference's largest magnitude (GEMMs summed in another order round differently)."""
    assert out.dtype == ref.dtype
    error, scale = (out.float() - ref.float()).abs().max(), ref.float().abs().max()
    assert error <= tolerance * scale, (error, scale)


def _forward_backward(module, *inputs):
    inputs = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = module(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).sum().backward()
    parameters = module.named_parameters() if isinstance(module, torch.nn.Module) else ()
    return out.detach(), [x.grad for x in inputs if x.is_floating_point()], {name: p.grad for name, p in parameters}


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centered_rms_norm_is_gemma3s_to_the_bit(dtype):
    """Same forward and gradients bit for bit in fp32 and bf16: the gain applied in fp32, the product cast after
    (Llama's RMSNorm casts first, which in bf16 rounds differently: checked too, so the test can tell them apart)."""
    theirs, ours = hf.Gemma3RMSNorm(32, eps=1e-6), ZeroCenteredRMSNorm(32, eps=1e-6)
    assert torch.equal(ours.weight, theirs.weight)  # both start at zero
    _randomise(theirs)
    ours.load_state_dict(theirs.state_dict())
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    ref, ref_dx, ref_grads = _forward_backward(theirs, x)
    out, dx, grads = _forward_backward(ours, x)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert torch.equal(dx[0], ref_dx[0]) and torch.equal(grads["weight"], ref_grads["weight"])
    if dtype == torch.bfloat16:  # Llama's order of the cast: another result in 16 bits
        with torch.no_grad():
            x32 = x.float()
            cast_first = (1 + ours.weight) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        assert not torch.equal(cast_first, out)


def test_zero_centered_norms_start_at_zero_at_every_place_of_the_model():
    """The initializer asks the norm (``initialize_own_parameter``): its gains start at zero, so every norm is the
    identity gain, in the layers (four and the q/k norms) and the final one; other parameters are drawn as before.
    ``num_parameters`` counts what the model holds."""
    model = GPTModel(GEMMA)
    gains = {name: p for name, p in model.named_parameters() if p.dim() == 1}
    assert len(gains) == GEMMA.num_layers * 6 + 1
    assert all(not p.any() for p in gains.values())
    assert model.blocks["0"].mlp.fc.weight.std() > 0.01
    assert sum(p.numel() for p in model.parameters()) == GEMMA.num_parameters()  # four norms a layer, q/k norms
    llama_norms = GPTModel(replace(GEMMA, normalization="RMSNorm"))
    assert all(torch.equal(p, torch.ones_like(p)) for p in llama_norms.parameters() if p.dim() == 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_geglu_is_gemma3s_mlp(dtype):
    """``[gate | up]`` fused in one ``fc`` and the tanh GELU: transformers' ``Gemma3MLP`` (``gelu_pytorch_tanh``)."""
    theirs = hf.Gemma3MLP(_hf_config(GEMMA))
    _randomise(theirs)
    ours = GatedMLP(48, 64, activation="geglu")
    ours.load_state_dict({"fc.weight": torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]),
                          "proj.weight": theirs.down_proj.weight})
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = torch.randn(2, 7, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref, ref_dx, _ = _forward_backward(theirs, x)
    out, dx, _ = _forward_backward(ours, x)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    _close(out, ref, tolerance)
    _close(dx[0], ref_dx[0], tolerance)
    swiglu = GatedMLP(48, 64, activation="swiglu").to(dtype)
    swiglu.load_state_dict(ours.state_dict())
    with pytest.raises(AssertionError):
        _close(swiglu(x).detach(), out, tolerance)


def test_geglu_is_split_and_adapted_as_swiglu_is():
    """The same tensor-parallel plan (``fc`` as ``PackedColumn(2)``: each rank its share of gate and of up) and the
    same projections for LoRA (``gate``, ``up``) as the SwiGLU model; MoE experts and the shared expert GeGLU too."""
    from lightning_megatron.models.moe import MoEConfig

    swiglu = GPTModel(replace(GEMMA, activation="swiglu"))
    geglu = GPTModel(GEMMA)
    assert geglu.tensor_parallel_plan() == swiglu.tensor_parallel_plan()
    assert geglu.fused_projections() == swiglu.fused_projections()
    assert geglu.fused_projections()["blocks.*.mlp.fc"] == ("gate", "up")
    moe = GPTModel(replace(GEMMA, moe=MoEConfig(num_experts=2, top_k=1, shared_expert_size=32)))
    experts = [m for m in moe.modules() if isinstance(m, GatedMLP)]
    assert len(experts) == 2 * 3 and {m.activation for m in experts} == {"geglu"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_scaled_embedding_rounds_its_scale_as_transformers_does(dtype):
    """``embedding_multiplier``: the scale in the weight's dtype first (in bf16, sqrt(48) = 6.928... is 6.9375), so
    the embeddings are transformers' ``Gemma3TextScaledWordEmbedding``'s bit for bit, and their gradient too."""
    theirs = hf.Gemma3TextScaledWordEmbedding(96, 48, padding_idx=None, embed_scale=48 ** 0.5)
    _randomise(theirs)
    ours = GPTEmbedding(GEMMA)
    ours.wte.load_state_dict(theirs.state_dict())
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    ref, _, ref_grads = _forward_backward(theirs, ids)
    out, _, grads = _forward_backward(ours, ids)
    assert torch.equal(out, ref) and torch.equal(grads["wte.weight"], ref_grads["weight"])
    if dtype == torch.bfloat16:  # the exact scale, rounded once after the product, would give other numbers
        assert not torch.equal(out, (ours.wte(ids).float() * 48 ** 0.5).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sandwich_layer_is_gemma3s_decoder_layer(dtype):
    """Our ``TransformerLayer`` with the four zero-centred norms, q/k norms and GeGLU against ``Gemma3DecoderLayer``
    (full attention, ``query_pre_attn_scalar = head_dim``, no attention soft-capping), weights copied, forward and
    input gradient; the pre-norm layer with the same weights differs (the test sees the two extra norms)."""
    hf_config = _hf_config(GEMMA)
    theirs = hf.Gemma3DecoderLayer(hf_config, 0)
    _randomise(theirs)
    ours = gpt_layer(GEMMA)
    ours.load_state_dict(_layer_state(theirs, GEMMA))
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = torch.randn(2, 16, 48, generator=torch.Generator().manual_seed(4)).to(dtype)
    positions = torch.arange(16)[None].expand(2, -1)
    cos_sin = hf.Gemma3RotaryEmbedding(hf_config)(x, positions, "full_attention")
    causal = torch.full((16, 16), float("-inf")).triu(1).to(dtype)[None, None]
    ref, ref_dx, _ = _forward_backward(lambda h: theirs(h, position_embeddings=cos_sin, attention_mask=causal), x)
    out, dx, _ = _forward_backward(ours, x)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    _close(out, ref, tolerance)
    _close(dx[0], ref_dx[0], tolerance)
    pre_norm = gpt_layer(replace(GEMMA, norm_position="pre")).to(dtype)
    pre_norm.load_state_dict({k: v for k, v in ours.state_dict().items() if "post_" not in k})
    with pytest.raises(AssertionError):
        _close(pre_norm(x).detach(), out, tolerance)


def test_a_gemma_shaped_model_gives_transformers_logits():
    """The whole decoder (scaled embedding, sandwich layers, final norm, tied head, final soft-capping) against
    ``Gemma3ForCausalLM`` with every layer full attention: the logits, and transformers' loss."""
    hf_config = _hf_config(GEMMA)
    torch.manual_seed(0)
    theirs = hf.Gemma3ForCausalLM(hf_config).eval()
    _randomise(theirs)
    state = {"embedding.wte.weight": theirs.model.embed_tokens.weight.detach(),
             "ln_f.weight": theirs.model.norm.weight.detach(), "lm_head.weight": theirs.lm_head.weight.detach()}
    for index, layer in enumerate(theirs.model.layers):
        state.update(_layer_state(layer, GEMMA, f"blocks.{index}."))
    ours = GPTModel(GEMMA).eval()
    ours.load_state_dict(state)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = theirs(ids, labels=ids)
        logits = ours(ids)
        loss_sum, tokens = ours.loss(ids[:, :-1], ids[:, 1:])
    _close(logits, ref.logits, 1e-5)
    assert logits.abs().max() <= GEMMA.final_logit_softcapping
    torch.testing.assert_close(loss_sum / tokens, ref.loss, rtol=1e-5, atol=1e-6)


def test_soft_capping_keeps_a_vocab_shards_padding_out_of_the_softmax():
    """Vocab-parallel logits with padding columns (``-inf``, as ``VocabParallelHead`` makes them): capped, the padding
    stays ``-inf`` (``tanh`` would make it ``-cap``) and the mark stays; the real columns are ``cap * tanh(z / cap)``."""
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(6)) * 10
    logits[:, 5:] = float("-inf")
    shard = VocabShard(None, 0, 5, 8, 5)
    capped = soft_cap(mark_vocab_parallel(logits, shard), 2.0)
    assert capped.vocab_shard == shard
    assert torch.equal(capped.as_subclass(torch.Tensor)[:, :5], 2.0 * torch.tanh(logits[:, :5] / 2.0))
    assert torch.isneginf(capped.as_subclass(torch.Tensor)[:, 5:]).all()
    assert soft_cap(logits, None) is logits


@pytest.mark.parametrize("chunk_tokens", [7, 4096])
def test_chunked_loss_with_soft_capping_gives_the_unchunked_loss_and_gradients(chunk_tokens):
    """``loss_chunk_tokens`` with ``final_logit_softcapping``: the forward caps each chunk, the backward multiplies by
    ``1 - tanh^2``; loss and every gradient are the unchunked model's (whose cap autograd differentiates). The cap is
    tight enough to change the loss (checked against the uncapped model)."""
    config = replace(GEMMA, final_logit_softcapping=0.5)
    torch.manual_seed(0)
    unchunked = GPTModel(config)
    _randomise(unchunked)
    chunked = GPTModel(replace(config, loss_chunk_tokens=chunk_tokens))
    chunked.load_state_dict(unchunked.state_dict())
    uncapped = GPTModel(replace(config, final_logit_softcapping=None))
    uncapped.load_state_dict(unchunked.state_dict())
    generator = torch.Generator().manual_seed(7)
    ids, labels = torch.randint(0, 96, (3, 16), generator=generator), torch.randint(0, 96, (3, 16), generator=generator)
    labels[0, :5] = -100

    def step(model):
        loss_sum, tokens = model.loss(ids, labels)
        (loss_sum / tokens).backward()
        return loss_sum.detach() / tokens, {name: p.grad for name, p in model.named_parameters()}

    ref_loss, ref_grads = step(unchunked)
    loss, grads = step(chunked)
    assert abs(loss - ref_loss) / ref_loss < 1e-6
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).abs().max() < 1e-6 * max(1.0, ref_grads[name].abs().max()), name
    assert abs(step(uncapped)[0] - ref_loss) > 1e-3


def test_the_pieces_add_the_saved_activations_the_planner_counts():
    """bf16, measured by the planner's own probes against its formulas, each piece against the model without it (so
    every other term cancels): the zero-centred norms keep their normalised input in fp32 (the q/k norms too), the
    sandwich adds two norms per layer, GeGLU keeps what SwiGLU keeps, the scaled embedding nothing; the zero-centred
    norms' fp32 gains ``1 + w``, one per norm call, are parameter-sized and left out of the per-token formula. The
    soft-capped head keeps its ``tanh``'s output (``V / t`` per token), and the chunked loss nothing more at its peak."""
    from lightning_megatron.plan.activations import _head_and_loss, layer_saved_bytes
    from lightning_megatron.plan.layout import Layout
    from lightning_megatron.plan.probes import SavedInLayers, head_loss_peak
    from lightning_megatron.plan.shape import ModelShape

    base = replace(GEMMA, normalization="RMSNorm", activation="swiglu", norm_position="pre", embedding_multiplier=None,
                   final_logit_softcapping=None)
    batch, seq, w = 2, 16, 2

    def shape(config):
        return ModelShape.of(type("Module", (), {"config": config})())

    def measured(config):
        torch.manual_seed(0)
        model = GPTModel(config).to(torch.bfloat16)
        ids = torch.randint(0, 96, (batch, seq))
        with SavedInLayers(model, list(model.blocks.values())) as saved:
            model.loss(ids, ids)[0].backward()
        return saved.bytes

    def predicted(config):
        return layer_saved_bytes(shape(config), Layout(), w) * batch * seq * config.num_layers

    reference = measured(base)
    h, d, layers, tokens = GEMMA.hidden_size, GEMMA.head_dim, GEMMA.num_layers, batch * seq
    gains = {"pre": 2 * h + 2 * d, "sandwich": 4 * h + 2 * d}  # fp32 elements of 1 + w per layer, zero-centred only
    for overrides in [dict(normalization="ZeroCenteredRMSNorm"), dict(norm_position="sandwich"),
                      dict(activation="geglu"), dict(embedding_multiplier=8.0),
                      dict(normalization="ZeroCenteredRMSNorm", norm_position="sandwich", activation="geglu")]:
        config = replace(base, **overrides)
        zero_centred = config.normalization == "ZeroCenteredRMSNorm"
        extra = layers * 4 * gains[config.norm_position] if zero_centred else 0
        added = measured(config)["layers"] - reference["layers"]
        assert added == predicted(config) - predicted(base) + extra, overrides
        assert (added > 0) == (overrides.keys() & {"normalization", "norm_position"} != set()), overrides
    capped = replace(base, final_logit_softcapping=2.0)
    assert measured(capped)["outside"] - reference["outside"] == tokens * GEMMA.vocab_size * w
    formula = [_head_and_loss(shape(config), tokens, GEMMA.vocab_size, h, w, 1, False)[0] for config in (base, capped)]
    assert formula[1] - formula[0] == GEMMA.vocab_size * w
    # fp32 probes of the head and loss alone: unchunked, one more [tokens, V] (the tanh's output); chunked, no more.
    peaks = {(chunk, cap): head_loss_peak(tokens=128, hidden=16, vocab=1024, chunk_tokens=chunk, softcap=cap)["peak_bytes"]
             for chunk in (None, 16) for cap in (None, 2.0)}
    assert peaks[None, 2.0] - peaks[None, None] == 128 * 1024 * 4
    assert peaks[16, 2.0] == peaks[16, None]


@pytest.mark.parametrize("overrides", [dict(norm_position="sandwich"), dict(embedding_multiplier=8.0),
                                       dict(final_logit_softcapping=30.0), dict(activation="geglu")])
def test_a_llama_with_a_gemma_piece_is_not_exported_as_a_llama(overrides):
    """The Llama-shaped families (and GPT-2) have none of these pieces: the export names the field instead of
    writing a config.json that transformers would compute differently (the cap and the scale have no weights)."""
    from lightning_megatron.huggingface.llama import LLAMA

    field = next(iter(overrides))
    with pytest.raises(ValueError, match=rf"{field}={overrides[field]!r} \(LlamaForCausalLM has"):
        LLAMA.hf_config(GPTConfig.from_name("llama-tiny", **overrides))
