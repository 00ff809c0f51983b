"""Native GPT-OSS (``GptOssForCausalLM``) in one process: a tiny random transformers model (sinks, biases, YaRN,
alternating sliding/full layers, clamped-SwiGLU experts, all random and non-zero) gives the same logits, gradients and
greedy tokens as ours, exports back exactly through ``from_pretrained``; YaRN's frequencies equal transformers';
the presets' parameter counts equal transformers' meta models; what we cannot compute is refused by name."""

import json

import pytest
import torch

from lightning_megatron.huggingface import FAMILIES, family_for
from lightning_megatron.models import GPT, GPTConfig
from lightning_megatron.models.rotary import RopeScaling, cos_sin, inverse_frequencies
from lightning_megatron.parallel.config import ParallelConfig

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 97, 16


def tiny_hf_config(**overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                  initializer_range=0.1,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
    config = transformers.GptOssConfig(**{**fields, **overrides})
    config._attn_implementation = "eager"
    return config


def tiny_hf_model():
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(tiny_hf_config()).eval()
    with torch.no_grad():  # every bias, sink and router bias non-zero (transformers starts the biases at zero)
        for name, param in hf.named_parameters():
            if param.dim() == 1 and "norm" not in name or name.endswith("_bias"):
                param.normal_(0.0, 0.5)
    return hf


def test_logits_gradients_generation_and_export_match_transformers(tmp_path):
    hf = tiny_hf_model()
    input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    gpt = GPT.from_hf(hf).eval()
    config = gpt.config
    assert config.attention_sinks and config.add_attention_bias and config.activation == "clamped_swiglu"
    assert config.rope_scaling.rope_type == "yarn" and config.layer_types == ("sliding_attention", "full_attention")

    expected = hf(input_ids).logits
    ours = gpt(input_ids)
    assert (ours - expected).abs().max().item() <= 1e-4
    # gradients of GPT-OSS's own pieces: the sinks, the attention, router and expert biases
    expected.square().mean().backward()
    ours.square().mean().backward()
    layer, theirs = gpt.model.blocks["0"], hf.model.layers[0]
    gradients = {"sinks": (layer.attn.sinks.grad, theirs.self_attn.sinks.grad),
                 "o bias": (layer.attn.proj.bias.grad, theirs.self_attn.o_proj.bias.grad),
                 "router bias": (layer.mlp.router.bias.grad, theirs.mlp.router.bias.grad),
                 "expert 1's down bias": (layer.mlp.experts["1"].proj.bias.grad,
                                          theirs.mlp.experts.down_proj_bias.grad[1])}
    for name, (mine, reference) in gradients.items():
        assert reference.abs().sum() > 0 and torch.allclose(mine, reference, atol=1e-5), name

    # to_hf: stacked, interleaved experts written as GPT-OSS stores them; from_pretrained gives the same tensors
    gpt.to_hf(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    assert fields["model_type"] == "gpt_oss" and fields["rope_parameters"]["rope_type"] == "yarn"
    back = transformers.GptOssForCausalLM.from_pretrained(tmp_path).state_dict()
    original = hf.state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], value) for name, value in original.items())
    assert family_for(config).model_type == "gpt_oss"

    # greedy generation past the sliding window, through the KV cache
    prompt = input_ids[:1, :6]
    with torch.no_grad():
        reference = hf.generate(prompt, max_new_tokens=8, do_sample=False)[0, 6:].tolist()
    assert len(set(reference)) > 2  # not one token repeated: a wrong cache would show
    assert gpt.generate(prompt, max_new_tokens=8)[0, 6:].tolist() == reference


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_and_attention_factor_match_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate, "original_max_position_embeddings": 4096}
    hf_config = tiny_hf_config(rope_parameters=rope, head_dim=64, max_position_embeddings=131072)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    scaling = RopeScaling(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, truncate=truncate)
    ours = inverse_frequencies(64, 150000.0, scaling)
    assert torch.allclose(ours, inv_freq, rtol=1e-6, atol=0)
    assert scaling.cos_sin_factor() == pytest.approx(factor)
    cos, _ = cos_sin(torch.arange(3), ours, torch.float32, scaling.cos_sin_factor())
    assert cos[0, 0].item() == pytest.approx(factor)  # cos(0) scaled by the attention factor


@pytest.mark.parametrize("name,layers,experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_presets_count_what_transformers_builds(name, layers, experts):
    config = GPTConfig.from_name(name)
    hf_config = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts, router_aux_loss_coef=0.9)
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(hf_config)
    total = sum(param.numel() for param in hf.parameters())
    every_expert = sum(param[0].numel() for key, param in hf.named_parameters() if ".mlp.experts." in key)
    assert config.num_parameters() == total
    assert config.num_active_parameters() == total - (experts - config.moe.top_k) * every_expert
    assert FAMILIES["gpt_oss"].config_from_hf(hf_config.to_dict(), []) == config


def test_what_gpt_oss_cannot_compute_is_refused_by_name():
    family = FAMILIES["gpt_oss"]
    quantized = {**tiny_hf_config().to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ValueError, match=r"quantization_config.*Mxfp4Config\(dequantize=True\)"):
        family.config_from_hf(quantized, [])
    with pytest.raises(ValueError, match="swiglu_limit=5.0"):
        family.config_from_hf({**tiny_hf_config().to_dict(), "swiglu_limit": 5.0}, [])
    config = GPT.from_hf(tiny_hf_model()).config
    with pytest.raises(ValueError, match="attention_sinks=True"):  # a Llama has no sinks
        family_for(config, "llama").hf_config(config)


@pytest.mark.parametrize("window,packed", [(None, False), (4, True)])
def test_sinks_on_the_block_attention_path_match_the_dense_path(window, packed):
    """The sink merged last into the online softmax (``context_parallel.local``, O(S) memory) gives the dense
    attention's output and gradients, the sinks' own included, with a window and with packed documents."""
    from lightning_megatron.context_parallel.documents import DocumentMask
    from lightning_megatron.models.attention import CoreAttention
    from lightning_megatron.models.softcap import softcapped_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, SEQ, 8, generator=generator, requires_grad=True) for heads in (4, 2, 2))
    sinks = torch.randn(4, generator=generator, requires_grad=True)
    documents = DocumentMask(torch.tensor([[0] * 5 + [1] * 11, [0] * 16])) if packed else None
    core = CoreAttention(attention_dropout=0.0, causal=True, window=window)
    grad = torch.randn(2, 4, SEQ, 8, generator=generator)
    blockwise = core(q, k, v, documents, sinks=sinks)
    dense = softcapped_attention(q, k, v, core._keep(q, k, documents, True, window), cap=None, sinks=sinks)
    assert torch.allclose(blockwise, dense, atol=1e-5)
    for ours, reference in zip(torch.autograd.grad(blockwise, (q, k, v, sinks), grad),
                               torch.autograd.grad(dense, (q, k, v, sinks), grad)):
        assert torch.allclose(ours, reference, atol=1e-5)
