"""DeepSeek-V3's pieces against transformers' modules with the same weights: multi-head latent attention
(``models.latent_attention``) and the MoE layer with sigmoid routing, the score-correction bias, group-limited
top-k, the routed scaling factor and a shared expert (``models.router``, ``models.moe``)."""

import math

import pytest
import torch

from lightning_megatron.context_parallel.documents import DocumentMask
from lightning_megatron.models.gpt import GPTConfig, gpt_layer
from lightning_megatron.models.moe import MoE, MoEConfig

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention,
    DeepseekV3MoE,
    DeepseekV3RotaryEmbedding,
)

MLA = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
TINY = dict(hidden_size=64, num_heads=4, num_layers=1, normalization="RMSNorm", position_embedding_type="rope",
            activation="swiglu", add_bias_linear=False, layer_norm_eps=1e-6, tie_embeddings=False)
#: Our attention's modules <-> transformers'.
ATTENTION_NAMES = {"kv_down": "kv_a_proj_with_mqa", "kv_down_norm": "kv_a_layernorm", "kv_up": "kv_b_proj",
                   "proj": "o_proj", "q": "q_proj", "q_down": "q_a_proj", "q_down_norm": "q_a_layernorm",
                   "q_up": "q_b_proj"}


def hf_config(q_lora_rank, **overrides) -> DeepseekV3Config:
    fields = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                  rope_interleave=False, attn_implementation="eager", n_routed_experts=8, num_experts_per_tok=2,
                  n_group=2, topk_group=1, moe_intermediate_size=16, n_shared_experts=2, routed_scaling_factor=2.5,
                  **{key: value for key, value in MLA.items()})
    return DeepseekV3Config(**{**fields, **overrides})


def random_(module: torch.nn.Module, std: float = 0.3) -> None:
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, std)


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_latent_attention_is_transformers_deepseek_v3_attention(q_lora_rank):
    torch.manual_seed(0)
    config = hf_config(q_lora_rank)
    theirs = DeepseekV3Attention(config, 0).float()
    random_(theirs)
    ours = gpt_layer(GPTConfig(**TINY, mla=dict(MLA, q_lora_rank=q_lora_rank)), 0).attn
    with torch.no_grad():
        for name, module in ours.named_children():
            if name in ATTENTION_NAMES:
                module.weight.copy_(getattr(theirs, ATTENTION_NAMES[name]).weight)
    x = torch.randn(2, 12, 64, requires_grad=True)
    cos, sin = DeepseekV3RotaryEmbedding(config)(x, torch.arange(12)[None])
    expected, _ = theirs(x, (cos, sin), torch.full((12, 12), float("-inf")).triu(1)[None, None])
    got = ours(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # gradients too: the input's, and a down projection's, which every head's rotary key reaches
    grad_x, grad_w = torch.autograd.grad(got.square().sum(), (x, ours.kv_down.weight))
    expected_x, expected_w = torch.autograd.grad(expected.square().sum(), (x, theirs.kv_a_proj_with_mqa.weight))
    torch.testing.assert_close(grad_x, expected_x, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grad_w, expected_w, atol=1e-4, rtol=1e-4)


def test_latent_attention_over_packed_documents_is_attention_over_each_document():
    """Document masks (the O(S) block path, where values narrower than the keys are padded) give each document's
    own attention: two packed documents = the two attended apart."""
    torch.manual_seed(1)
    attention = gpt_layer(GPTConfig(**TINY, mla=dict(MLA, q_lora_rank=32)), 0).attn
    random_(attention)
    x = torch.randn(1, 10, 64)
    ids = torch.tensor([[0] * 6 + [1] * 4])
    positions = torch.cat([torch.arange(6), torch.arange(4)])[None]
    packed = attention(x, DocumentMask(ids), positions)
    apart = torch.cat([attention(x[:, :6]), attention(x[:, 6:])], dim=1)
    torch.testing.assert_close(packed, apart, atol=1e-5, rtol=1e-5)


def test_deepseek_moe_is_transformers_with_groups_bias_scaling_and_shared_experts():
    torch.manual_seed(2)
    config = hf_config(None)
    theirs = DeepseekV3MoE(config).float()
    random_(theirs)
    with torch.no_grad():  # the score-correction bias decides the choice: big enough to change it
        theirs.gate.e_score_correction_bias.normal_(0.0, 0.5)
    moe = MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=16, score_function="sigmoid", expert_bias=True,
                    shared_expert_size=32, router_num_groups=2, router_group_topk=1, router_topk_scaling_factor=2.5)
    ours = MoE(64, moe, default_ffn_size=128, activation="swiglu").eval()
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.router.expert_bias.copy_(theirs.gate.e_score_correction_bias)
        for index, expert in ours.experts.items():
            expert.fc.weight.copy_(theirs.experts.gate_up_proj[int(index)])  # [gate; up], as ours
            expert.proj.weight.copy_(theirs.experts.down_proj[int(index)])
        shared = theirs.shared_experts
        ours.shared_expert.fc.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        ours.shared_expert.proj.weight.copy_(shared.down_proj.weight)
    x = torch.randn(3, 10, 64)
    _, weights, ids = theirs.gate(x)
    routing = ours.router(x)
    assert torch.equal(routing.expert_ids.reshape(-1, 2).sort(-1).values, ids.sort(-1).values)
    # one group of four experts per token: every choice lies in one group, and the bias moved some
    assert torch.equal(ids.min(-1).values // 4, ids.max(-1).values // 4)
    bias = ours.router.expert_bias.clone()
    ours.router.expert_bias.zero_()
    assert not torch.equal(ours.router(x).expert_ids, routing.expert_ids)  # so a bias read wrongly would show
    ours.router.expert_bias.copy_(bias)
    torch.testing.assert_close(routing.weights.reshape(-1, 2).sum(-1), torch.full((30,), 2.5))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_group_settings_are_checked():
    with pytest.raises(ValueError, match="needs both"):
        MoEConfig(num_experts=8, router_num_groups=2)
    with pytest.raises(ValueError, match="divide num_experts"):
        MoEConfig(num_experts=8, router_num_groups=3, router_group_topk=1)
    with pytest.raises(ValueError, match="at least top_k"):
        MoEConfig(num_experts=8, top_k=4, router_num_groups=4, router_group_topk=1)
    with pytest.raises(ValueError, match="has no meaning"):
        GPTConfig(**{**TINY, "num_query_groups": 2}, mla=MLA)


# ----------------------------------------------------------------------------- the DeepseekV3ForCausalLM dialect
#: deepseek-ai/DeepSeek-V3's config.json: rope_theta and rope_scaling (YaRN with DeepSeek's mscale and mscale_all_dim).
PUBLISHED_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny_hf_model(**overrides):
    """The issue's tiny random DeepseekV3ForCausalLM: 3 layers (one dense), 8 experts in 2 groups, interleaved rope
    (transformers' default), random score-correction biases."""
    torch.manual_seed(3)
    config = DeepseekV3Config(**overrides,vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                              kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                              first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=64,
                              initializer_range=0.1)
    hf = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return hf


@pytest.mark.parametrize("rope", [None, PUBLISHED_ROPE, {**PUBLISHED_ROPE, "mscale": 0.707}],
                         ids=["unscaled", "published-yarn", "yarn-mscale-0.707"])
def test_converted_deepseek_v3_gives_transformers_logits_and_exports_back(tmp_path, rope):
    """Also with the published model's YaRN (mscale = mscale_all_dim = 1: cos/sin unscaled, the softmax scale times
    (0.1 ln 40 + 1) ** 2) and with mscale 0.707 (cos/sin scaled too), both of which change the logits."""
    from lightning_megatron.huggingface import FAMILIES
    from lightning_megatron.models import GPT

    hf = tiny_hf_model(**({} if rope is None else {"rope_parameters": rope}))
    input_ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids).logits
    gpt = GPT.from_hf(hf).eval()
    if rope is not None:
        assert gpt.config.rope_scaling.cos_sin_factor() == (1.0 if rope["mscale"] == 1.0 else pytest.approx(
            (0.707 * 0.1 * math.log(40) + 1) / (0.1 * math.log(40) + 1)))
        assert gpt.config.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert gpt.config.moe.layer_freq == (0, 1, 1) and gpt.config.num_parameters() == sum(
        p.numel() for p in hf.parameters())
    with torch.no_grad():
        torch.testing.assert_close(gpt(input_ids), expected, atol=1e-4, rtol=0)
    family = FAMILIES["deepseek_v3"]
    stored = family.canonical_hf_state_dict(hf.state_dict(), gpt.config)  # one tensor per expert
    back = family.hf_state_dict(gpt.model.state_dict(), gpt.config)
    assert back.keys() == stored.keys() and all(torch.equal(back[name], value) for name, value in stored.items())
    gpt.to_hf(tmp_path)  # written as save_pretrained writes it; transformers loads it and computes the same
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, expected, atol=1e-5, rtol=0)
    assert GPT.from_hf(tmp_path).config == gpt.config


def test_interleaved_rope_rows_are_permuted_not_copied():
    """Read with the rope rows as they are (no permutation), the logits differ: the test above sees the layout."""
    from lightning_megatron.huggingface.deepseek_v3 import InterleavedRope

    rope = InterleavedRope(heads=2, nope=3, rope=4)
    weight = torch.arange(14.0)[:, None]
    ours = rope.to_ours([weight]).flatten().tolist()
    assert ours == [0, 1, 2, 3, 5, 4, 6, 7, 8, 9, 10, 12, 11, 13]
    assert torch.equal(rope.to_hf(rope.to_ours([weight]))[0], weight)


def test_deepseek_v3_preset_counts_transformers_parameters():
    """The 671B preset's total and active parameters are those of transformers' model of its exported config
    (built on the meta device): 671,026,404,352 and 37,552,282,624 (8 of 256 experts in 58 MoE layers)."""
    from lightning_megatron.huggingface import FAMILIES

    config = GPTConfig.from_name("deepseek-v3")
    fields = FAMILIES["deepseek_v3"].hf_config(config)
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in fields.items()
                                                                   if k != "architectures"}))
    total = sum(p.numel() for p in hf.parameters())
    moe = config.moe
    idle = sum((layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel())
               * (moe.num_experts - moe.top_k) // moe.num_experts
               for layer in hf.model.layers if hasattr(layer.mlp, "experts"))
    assert (config.num_parameters(), config.num_active_parameters()) == (total, total - idle)
    assert (total, total - idle) == (671_026_404_352, 37_552_282_624)
    assert (fields["max_position_embeddings"], fields["rope_theta"]) == (163840, PUBLISHED_ROPE["rope_theta"])
    published = {key: value for key, value in PUBLISHED_ROPE.items() if key != "rope_theta"}
    assert {key: fields["rope_scaling"][key] for key in published} == published
    assert hf.model.layers[0].self_attn.scaling == config.softmax_scale  # transformers' own softmax scale


@pytest.mark.parametrize("mscale, mscale_all_dim", [(None, None), (1.0, 1.0), (0.707, 1.0), (None, 0.5), (0.0, 1.0),
                                                    (0.8, None)])
def test_yarn_mscale_factors_are_transformers(mscale, mscale_all_dim):
    """``RopeScaling``'s cos/sin factor is transformers' YaRN attention factor and its softmax factor what
    ``yarn_apply_mscale`` multiplies the softmax scale by, for every way of setting (or not) the two mscales."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from lightning_megatron.models.rotary import RopeScaling

    mscales = {key: value for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim))
               if value is not None}
    rope = {**PUBLISHED_ROPE, "mscale": None, "mscale_all_dim": None, **mscales}
    config = DeepseekV3Config(rope_parameters={k: v for k, v in rope.items() if v is not None}, qk_rope_head_dim=8)
    _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = RopeScaling(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=mscale,
                          mscale_all_dim=mscale_all_dim)
    assert scaling.cos_sin_factor() == pytest.approx(attention_factor, rel=1e-12)
    assert scaling.softmax_scale_factor() == pytest.approx(yarn_apply_mscale(config.rope_parameters, 1.0), rel=1e-12)
    with pytest.raises(ValueError, match="mscale and mscale_all_dim are YaRN's"):
        RopeScaling(rope_type="linear", factor=4.0, mscale_all_dim=1.0)


@pytest.mark.parametrize("field, value, message", [
    ("rope_interleave", False, "rope_interleave=False"), ("attention_bias", True, "attention_bias=True"),
    ("rms_norm_eps", 1e-5, "rms_norm_eps=1e-05"), ("hidden_act", "gelu", "hidden_act='gelu'")])
def test_unconvertible_deepseek_v3_configs_are_refused_by_name(field, value, message):
    from lightning_megatron.huggingface.deepseek_v3 import config_from_hf

    with pytest.raises(ValueError, match=message):
        config_from_hf({**tiny_hf_model().config.to_dict(), field: value})


def test_generation_with_the_kv_cache_is_greedy_decoding_of_whole_sequences():
    """The cache holds each head's keys and (padded) values: cached steps give the tokens full forwards give."""
    from lightning_megatron.models import GPT

    torch.manual_seed(4)
    gpt = GPT("deepseek-v3-tiny")
    gpt.configure_model()
    gpt.eval()
    random_(gpt.model, std=0.2)
    prompt = [5, 17, 200, 3]
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            tokens.append(int(gpt(torch.tensor([tokens]))[0, -1].argmax()))
    assert gpt.generate([prompt], max_new_tokens=6)[0] == tokens
