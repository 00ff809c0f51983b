"""Per-layer attention types: a real sliding window at any length, per-layer rotary bases, ``softmax_scale`` and
soft-capped scores (``GPTConfig.sliding_window``, ``layer_types``, ``rotary_base_local``, ``softmax_scale``,
``attn_logit_softcapping``), each against ``transformers`` built in the test: our ``SelfAttention`` against
``Gemma3Attention`` of either layer type (weights copied), Mistral and Qwen2 with windows shorter than the sequence
(logits, export, greedy generation), and packed documents under a window equal to each document run alone. The
layouts (tp2, cp2 with a window): ``test_layout_invariance.py``."""

import importlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from workers.hf_llama_setup import build_hf_model
from lightning_megatron.context_parallel.masks import BlockPattern
from lightning_megatron.huggingface.llama import hf_config_from_llama, llama_config_from_hf
from lightning_megatron.huggingface.mapping import QueryGroups
from lightning_megatron.huggingface.mistral import hf_config_from_mistral
from lightning_megatron.huggingface.qwen2 import hf_config_from_qwen2
from lightning_megatron.models import GPT, GPTConfig, GPTModel, RopeScaling
from lightning_megatron.models.gpt import LLAMA, gpt_layer

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function  # noqa: E402

BATCH, SEQ, WINDOW = 2, 16, 5
GEMMA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
             sliding_window=WINDOW, attn_logit_softcapping=3.0, num_hidden_layers=2, rms_norm_eps=1e-6,
             layer_types=["sliding_attention", "full_attention"], intermediate_size=96, vocab_size=64,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})


def _gemma_pair(family: str, index: int):
    """transformers' ``Gemma3Attention`` or ``Gemma2Attention`` of layer ``index`` (eager attention) and ours with
    its weights, both in fp64. transformers 5.25's ``Gemma3Attention`` does not soft-cap its scores (it does not pass
    its config's ``attn_logit_softcapping`` on), ``Gemma2Attention`` does: the cap is checked against Gemma 2's."""
    gemma3 = family == "gemma3"
    fields = {**GEMMA, **({"attn_logit_softcapping": None} if gemma3 else {"rope_parameters": None})}
    hf_config = getattr(transformers, f"Gemma{family[-1]}Config" if not gemma3 else "Gemma3TextConfig")(**fields)
    hf_config._attn_implementation = "eager"
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(0)
    theirs = getattr(modeling, f"Gemma{family[-1]}Attention")(hf_config, index).double().eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0.0, 0.3)
    rotary = dict(rotary_base=1e6, rope_scaling=RopeScaling(factor=8.0, rope_type="linear"), rotary_base_local=1e4)
    config = GPTConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_query_groups=2, kv_channels=16,
                       qk_layernorm=gemma3, layer_norm_eps=1e-6, sliding_window=WINDOW,
                       layer_types=("sliding_attention", "full_attention"), softmax_scale=24 ** -0.5,
                       attn_logit_softcapping=hf_config.attn_logit_softcapping, **(rotary if gemma3 else {}), **LLAMA)
    ours = gpt_layer(config, index).attn.double().eval()
    with torch.no_grad():
        ours.qkv.weight.copy_(QueryGroups(4, 2).to_ours([getattr(theirs, f"{p}_proj").weight for p in "qkv"]))
        ours.proj.weight.copy_(theirs.o_proj.weight)
        if gemma3:
            ours.q_norm.weight.copy_(1 + theirs.q_norm.weight)  # Gemma's RMSNorm scales by (1 + w)
            ours.k_norm.weight.copy_(1 + theirs.k_norm.weight)
    rotary = getattr(modeling, f"Gemma{family[-1]}RotaryEmbedding")(hf_config)
    return hf_config, theirs, ours, rotary


def _hf_mask(window):
    """transformers' own mask functions, evaluated at every (query, key), as eager attention's additive mask."""
    q, k = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    keep = (causal_mask_function if window is None else sliding_window_causal_mask_function(window))(0, 0, q, k)
    return torch.zeros(1, 1, SEQ, SEQ, dtype=torch.float64).masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("index", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_attention_matches_transformers_gemma_attention(family, index):
    """Each layer type's window, rotary base and scaling, ``query_pre_attn_scalar`` (Gemma 3) and soft-capping
    (Gemma 2) as transformers' attention modules compute them, forward and the input's gradient, at a sequence three
    times the window. Their eager softmax runs in fp32, hence the tolerance in fp64."""
    hf_config, theirs, ours, rotary = _gemma_pair(family, index)
    layer_type = hf_config.layer_types[index]
    x = torch.randn(BATCH, SEQ, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ)[None].expand(BATCH, -1)
    cos, sin = rotary(x, positions, layer_type) if family == "gemma3" else rotary(x, positions)
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = theirs(x_theirs, (cos.double(), sin.double()), _hf_mask(theirs.sliding_window))[0]
    got = ours(x_ours)
    assert (got - expected).abs().max() < 1e-5
    expected.square().sum().backward()
    got.square().sum().backward()
    assert (x_ours.grad - x_theirs.grad).abs().max() < 1e-5 * x_theirs.grad.abs().max()


def test_config_checks_and_per_layer_pieces():
    base = dict(num_layers=3, **LLAMA)
    assert GPTConfig(sliding_window=4, layer_types=["sliding_attention"] * 3, **base).layer_types is None  # default
    config = GPTConfig(sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                       rotary_base_local=10.0, rope_scaling=RopeScaling(factor=2.0, rope_type="linear"), **base)
    assert isinstance(config.layer_types, tuple)
    assert [config.attention_window(i) for i in range(3)] == [4, None, 4]
    assert config.rotary_of(0) == (10.0, None) and config.rotary_of(1) == (10000.0, config.rope_scaling)
    for fields, message in [
        (dict(layer_types=("full_attention",) * 2), "names 2 layers but num_layers=3"),
        (dict(layer_types=("full_attention", "local", "global")), r"\['global', 'local'\]"),
        (dict(layer_types=("sliding_attention",) * 3), "sliding_window=None: set the window's size"),
        (dict(sliding_window=0), "must be >= 1"),
        (dict(softmax_scale=0.0), "softmax_scale=0.0 must be positive"),
        (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping=-1.0 must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            GPTConfig(**{**base, **fields})
    with pytest.raises(ValueError, match="rotary_base_local is the rotary base of sliding-window layers"):
        GPTConfig(rotary_base_local=10.0)


def _tiny(**fields) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(GPTConfig.from_name("llama-tiny", num_layers=2, vocab_size=64, **fields)).double().eval()


@pytest.mark.parametrize("fields", [dict(sliding_window=3), dict(sliding_window=3, attn_logit_softcapping=2.0),
                                    dict(sliding_window=3, layer_types=("full_attention", "sliding_attention"),
                                         softmax_scale=0.5, rotary_base_local=100.0)],
                         ids=["window", "window+softcap", "mixed+scale"])
def test_packed_documents_under_a_window_equal_each_document_alone(fields):
    model = _tiny(**fields)
    lengths = [7, 2, 9, 6]
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(ids, position_ids=positions, document_ids=documents)
    alone = torch.cat([model(part) for part in ids.split(lengths, dim=1)], dim=1)
    assert (packed - alone).abs().max() < 1e-10
    whole = model(ids)  # the window reaches across documents when they are not separated
    assert (whole - packed).abs().max() > 1e-3


def test_window_is_transformers_mask_and_every_path_keeps_it():
    """Our pattern is transformers' ``sliding_window_causal_mask_function``; the block path (no [S, S] mask), SDPA
    over the mask (attention dropout's path) and the soft-capping path with an infinite cap all agree."""
    q, k = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    pattern = BlockPattern(q_pos=torch.arange(SEQ), k_pos=torch.arange(SEQ), causal=True, window=WINDOW)
    assert torch.equal(pattern.keep()[0, 0], sliding_window_causal_mask_function(WINDOW)(0, 0, q, k))
    attention = gpt_layer(GPTConfig.from_name("llama-tiny", sliding_window=WINDOW), 0).attn.core_attention
    g = torch.Generator().manual_seed(3)
    qs, ks, vs = (torch.randn(2, 4 if i == 0 else 2, SEQ, 16, dtype=torch.float64, generator=g) for i in range(3))
    dense = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=pattern.keep(), enable_gqa=True)
    assert (attention(qs, ks, vs) - dense).abs().max() < 1e-12
    assert (attention._keep(qs, ks, None, True, WINDOW) == pattern.keep()).all()
    attention.softcap = 1e9
    assert (attention(qs, ks, vs) - dense).abs().max() < 1e-9


@pytest.mark.parametrize("case, fields", [("mistral", dict(sliding_window=8)),
                                          ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                                         max_window_layers=1))])
def test_windowed_models_convert_match_and_export_back(case, fields, tmp_path):
    hf = build_hf_model(case, **fields)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(ids).logits
        full = build_hf_model(case, **{**fields, "sliding_window": None})(ids).logits
    gpt = GPT.from_hf(hf).eval()
    assert gpt.config.sliding_window == 8 and gpt.config.max_seq_length == 64
    assert gpt.config.layer_types == (None if case == "mistral" else ("full_attention", "sliding_attention"))
    with torch.no_grad():
        assert (gpt(ids) - expected).abs().max() < 1e-4 < (full - expected).abs().max()  # the window matters
    gpt.to_hf(tmp_path, model_type=case)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.sliding_window == 8
    assert getattr(reloaded.config, "layer_types", None) == getattr(hf.config, "layer_types", None)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)
    assert GPT.from_hf(tmp_path).config == gpt.config


def test_export_refuses_what_a_family_cannot_hold():
    mixed = GPTConfig.from_name("llama-tiny", sliding_window=4, layer_types=("full_attention",) * 3 + ("sliding_attention",))
    with pytest.raises(ValueError, match="every MistralForCausalLM layer slides, or none does(.|\n)*'qwen2'"):
        hf_config_from_mistral(mixed)
    with pytest.raises(ValueError, match="sliding_window=4: LlamaForCausalLM attends to every earlier token"):
        hf_config_from_llama(mixed)
    with pytest.raises(ValueError, match="softmax_scale=0.5 \\(MistralForCausalLM has 1 / sqrt\\(head_dim\\)\\)"):
        hf_config_from_mistral(GPTConfig.from_name("llama-tiny", softmax_scale=0.5))
    assert hf_config_from_qwen2(replace(mixed, add_qkv_bias=True))["max_window_layers"] == 3


def test_greedy_generation_beyond_the_window_matches_transformers():
    """Left-padded prompts (the window counts cache positions, padding included, as transformers' does), 12 new
    tokens past a window of 4."""
    hf = build_hf_model("mistral", sliding_window=4)
    prompts = torch.randint(1, 300, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompts)
    mask[0, :3], prompts[0, :3] = 0, 0
    settings = dict(max_new_tokens=12, do_sample=False, attention_mask=mask, pad_token_id=0)
    expected = hf.generate(prompts, **settings)
    gpt = GPT.from_hf(hf).eval()
    assert gpt.generate(prompts, max_new_tokens=12, attention_mask=mask, pad_id=0).tolist() == expected.tolist()
    unwindowed = build_hf_model("mistral", sliding_window=None)
    assert unwindowed.generate(prompts, **settings).tolist() != expected.tolist()


def test_cached_generation_with_window_and_softcap_is_greedy_over_whole_sequences():
    """The KV cache's steps (a new token sees the last ``window`` keys; soft-capped scores) give the tokens of greedy
    decoding that recomputes the whole sequence every step."""
    model = _tiny(sliding_window=3, layer_types=("sliding_attention", "full_attention"), attn_logit_softcapping=1.0,
                  softmax_scale=0.3)
    gpt = GPT(model.config)
    gpt.model = model
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(6))
    tokens = prompt
    for _ in range(8):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert gpt.generate(prompt, max_new_tokens=8).tolist() == tokens.tolist()


def test_linear_rope_scaling_reads_and_writes_back():
    """Linear scaling (Gemma 3's global layers; checked against transformers above) in a Llama config.json."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    config = llama_config_from_hf({"model_type": "llama", "rope_parameters": rope})
    assert config.rope_scaling == RopeScaling(factor=2.0, rope_type="linear")
    assert hf_config_from_llama(config)["rope_parameters"] == rope
    with pytest.raises(ValueError, match=r"rope_type='ntk'\) is not one of \['linear', 'llama3', 'yarn'\]"):
        RopeScaling(rope_type="ntk")
