"""Hugging Face Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (its own configs: ``test_hf_gemma3.py``): logits parity at tp=1 and exact round trips through from_pretrained for every
case of ``workers/hf_llama_setup.py``, both spellings of the rotary settings, the family chosen from our config, the
published presets' configs, and clear errors for what cannot convert. The parallel layouts:
``test_hf_parity.py``; sharded exports and ``checkpoint convert``: ``test_hf_export.py``."""

from dataclasses import replace

import pytest
import torch

from workers.hf_llama_setup import CASES, MODEL_TYPES, TOLERANCE, build_hf_model, sample_input_ids
from lightning_megatron.huggingface import family_for
from lightning_megatron.huggingface.llama import hf_config_from_llama, hf_state_dict_from_llama, llama_config_from_hf
from lightning_megatron.huggingface.mistral import hf_config_from_mistral, mistral_config_from_hf
from lightning_megatron.huggingface.qwen2 import hf_config_from_qwen2, qwen2_config_from_hf
from lightning_megatron.huggingface.qwen3 import hf_config_from_qwen3, qwen3_config_from_hf
from lightning_megatron.models import GPT, GPTConfig, GPTModel, RopeScaling

transformers = pytest.importorskip("transformers")
BOOKKEEPING = {"_name_or_path", "architectures", "dtype", "transformers_version"}


@pytest.mark.parametrize("case", list(CASES))
def test_converted_model_matches_and_exports_back_exactly(case, tmp_path):
    hf = build_hf_model(case)
    input_ids = sample_input_ids()
    with torch.no_grad():
        expected = hf(input_ids).logits
    gpt = GPT.from_hf(hf, learning_rate=1e-4).eval()
    assert gpt.hparams.learning_rate == 1e-4 and gpt.config.normalization.endswith("RMSNorm")
    with torch.no_grad():
        deviation = (gpt(input_ids) - expected).abs().max().item()
    print(f"{case}: max |logit difference| {deviation:.2e} (logits up to {expected.abs().max():.2f})")
    assert deviation <= TOLERANCE

    hf_state = hf.state_dict()
    back = family_for(gpt.config, MODEL_TYPES[case]).hf_state_dict(gpt.model.state_dict(), gpt.config)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[name], value) for name, value in hf_state.items())

    gpt.to_hf(tmp_path, model_type=MODEL_TYPES[case] if case == "mistral" else None)  # Mistral: only when asked
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors"}
    reloaded = getattr(transformers, CASES[case][0]).from_pretrained(tmp_path).eval()
    assert reloaded.config.model_type == MODEL_TYPES[case]
    differing = {k for k, v in hf.config.to_dict().items() if reloaded.config.to_dict().get(k) != v}
    assert not differing - BOOKKEEPING, differing
    assert reloaded.state_dict().keys() == hf_state.keys()
    assert all(torch.equal(reloaded.state_dict()[name], value) for name, value in hf_state.items())
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, expected)
    assert GPT.from_hf(tmp_path).config == gpt.config  # and the directory reads back to the same config


def test_rotary_settings_read_in_both_spellings_and_json_defaults_fill_in():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected = RopeScaling(**scaling)
    transformers_5 = {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    transformers_4 = {"model_type": "llama", "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}}
    older = {"model_type": "llama", "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}}
    for fields in (transformers_5, transformers_4, older):
        config = llama_config_from_hf(fields)
        assert (config.rotary_base, config.rope_scaling) == (5e5, expected), fields
    # config.json written by older transformers holds only the fields that differ from LlamaConfig's defaults
    defaults = llama_config_from_hf({"model_type": "llama", "num_hidden_layers": 2})
    assert defaults == llama_config_from_hf(transformers.LlamaConfig(num_hidden_layers=2))
    assert (defaults.hidden_size, defaults.ffn_hidden_size, defaults.max_seq_length, defaults.layer_norm_eps) == (
        4096, 11008, 2048, 1e-6)
    assert mistral_config_from_hf({"model_type": "mistral", "sliding_window": None}) == mistral_config_from_hf(
        transformers.MistralConfig(sliding_window=None))
    assert qwen2_config_from_hf({"model_type": "qwen2"}) == qwen2_config_from_hf(transformers.Qwen2Config())
    assert qwen3_config_from_hf({"model_type": "qwen3"}) == qwen3_config_from_hf(transformers.Qwen3Config())


@pytest.mark.parametrize("preset, model_type", [("llama-tiny", "llama"), ("llama-3.2-1b", "llama"),
                                                ("llama-3.1-8b", "llama"), ("mistral-7b", "mistral"),
                                                ("qwen2.5-7b", "qwen2"), ("qwen3-0.6b", "qwen3"),
                                                ("qwen3-8b", "qwen3"), ("qwen3-32b", "qwen3")])
def test_presets_export_configs_transformers_reads_back(preset, model_type):
    config = GPTConfig.from_name(preset)
    family = family_for(config, model_type)
    fields = family.hf_config(config)
    hf_config = transformers.AutoConfig.for_model(**fields)
    assert family.config_from_hf(hf_config, ()) == config and family.config_from_hf(fields, ()) == config
    if preset == "llama-3.1-8b":  # the published config.json's numbers
        assert (hf_config.num_key_value_heads, hf_config.intermediate_size, hf_config.rope_parameters["rope_theta"],
                hf_config.rope_parameters["rope_type"], hf_config.rope_parameters["factor"]) == (8, 14336, 5e5, "llama3", 8.0)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "gelu", "hidden_act='gelu': our SwiGLU MLP gates with SiLU"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 4.0}, "rope_parameters.rope_type='dynamic'"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, "rope_parameters.rope_type='dynamic'"),
    ("rope_scaling", {"type": "longrope", "factor": 2.0}, "rope_scaling.rope_type='longrope'"),
    ("rope_parameters", {"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("rope_parameters", {"full_attention": {"rope_type": "default"}}, "rotary parameters per layer type"),
    ("attention_bias", True, "attention_bias=True with mlp_bias=False"),
    ("model_type", "mistral", "model_type='mistral': this converts 'llama' checkpoints"),
])
def test_unconvertible_config_raises(field, value, message):
    fields = build_hf_model("llama-gqa").config.to_dict() | {field: value}
    with pytest.raises(ValueError, match=f"cannot be converted to our GPT \\(LlamaForCausalLM\\)(.|\n)*{message}"):
        llama_config_from_hf(fields)


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"])
def test_qwen3_presets_count_the_parameters_of_transformers_model(preset):
    """The planner's count (the config's, and the model it builds) is transformers' Qwen3ForCausalLM's, built on
    the meta device from the preset's exported config: 0.6B ties its embeddings, q/k norms add 2 x 128 a layer."""
    config = GPTConfig.from_name(preset)
    hf_config = transformers.AutoConfig.for_model(**hf_config_from_qwen3(config))
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.Qwen3ForCausalLM(hf_config).parameters())
        built = sum(p.numel() for p in GPTModel(config).parameters())
    assert config.num_parameters() == expected == built
    # The model cards' "Number of Parameters"
    assert round(expected / 1e9, 1) == {"qwen3-0.6b": 0.6, "qwen3-4b": 4.0, "qwen3-8b": 8.2, "qwen3-14b": 14.8,
                                        "qwen3-32b": 32.8}[preset]


def test_qwen3_head_width_and_qk_norm_export_only_where_the_family_holds_them():
    qwen3 = GPTConfig.from_name("qwen3-8b")
    assert family_for(qwen3).model_type == "qwen3"  # the q/k norms choose the family
    with pytest.raises(ValueError, match="qk_layernorm=True \\(LlamaForCausalLM has False\\)"):
        hf_config_from_llama(qwen3)
    with pytest.raises(ValueError, match="qk_layernorm=False \\(Qwen3ForCausalLM has True\\)"):
        hf_config_from_qwen3(GPTConfig.from_name("llama-tiny"))
    wide = GPTConfig.from_name("qwen2.5-7b", kv_channels=256)
    with pytest.raises(ValueError, match="kv_channels=256: Qwen2ForCausalLM's heads are hidden_size / num_heads"):
        hf_config_from_qwen2(wide)
    assert hf_config_from_llama(replace(qwen3, qk_layernorm=False))["head_dim"] == 128  # Llama holds the width
    fields = build_hf_model("qwen3").config.to_dict()
    with pytest.raises(ValueError, match="attention_bias=True: Qwen3's biases on q, k, v and o"):
        qwen3_config_from_hf(fields | {"attention_bias": True})


def test_family_is_chosen_from_the_config_and_refuses_what_it_cannot_hold():
    llama = GPTConfig.from_name("llama-tiny")
    assert family_for(llama).model_type == "llama"
    assert family_for(GPTConfig.from_name("qwen2.5-7b")).model_type == "qwen2"  # biases on qkv alone
    assert family_for(llama, "mistral").model_type == "mistral"
    assert family_for(GPTConfig()).model_type == "gpt2"
    with pytest.raises(ValueError, match="model_type='bert' cannot hold a GPTConfig: choose one of .*'gpt2', .*'llama'"):
        family_for(llama, "bert")
    with pytest.raises(ValueError, match="add_qkv_bias=True without add_bias_linear(.|\n)*model_type='qwen2'"):
        hf_config_from_llama(GPTConfig.from_name("qwen2.5-7b"))
    with pytest.raises(ValueError, match="add_bias_linear=True, add_qkv_bias=False: MistralForCausalLM has no biases"):
        hf_config_from_mistral(GPTConfig.from_name("llama-tiny", add_bias_linear=True))
    with pytest.raises(ValueError, match="Qwen2ForCausalLM has biases on q, k and v only"):
        hf_config_from_qwen2(llama)
    learned = GPTConfig(normalization="RMSNorm", activation="swiglu", ffn_hidden_size=96)  # learned positions: GPT-2
    with pytest.raises(ValueError, match="no Hugging Face GPT-2 equivalent:\n  - normalization='RMSNorm' \\(GPT-2 has "
                                         "'LayerNorm'\\)\n  - activation='swiglu'(.|\n)*exports to the Llama family"):
        family_for(learned).hf_config(learned)
    rotary = GPTConfig(position_embedding_type="rope")  # rotary positions: the Llama family
    with pytest.raises(ValueError, match="no Hugging Face LlamaForCausalLM equivalent:\n  - normalization='LayerNorm' "
                                         "\\(LlamaForCausalLM has 'RMSNorm'\\)(.|\n)*export as 'gpt2'"):
        family_for(rotary).hf_config(rotary)
    with pytest.raises(ValueError, match=r"\['rope_theta'\] describe the architecture"):
        hf_config_from_llama(llama, rope_theta=1.0)


def test_state_dicts_that_cannot_convert_raise():
    hf = build_hf_model("qwen2")  # tied embeddings
    config = qwen2_config_from_hf(hf.config)
    untied = dict(hf.state_dict(), **{"lm_head.weight": torch.zeros(300, 64)})
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight, but the config ties "
                                         r"them \(tie_word_embeddings=True\)"):
        family_for(config, "qwen2").state_dict_from_hf(untied, config)
    no_bias = {name: value for name, value in hf.state_dict().items() if not name.endswith("k_proj.bias")}
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM state dict does not match the config:\n  - missing: "
                                         r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        family_for(config, "qwen2").state_dict_from_hf(no_bias, config)
    ours = family_for(config, "qwen2").state_dict_from_hf(hf.state_dict(), config)
    shard = dict(ours, **{"blocks.0.attn.qkv.weight": ours["blocks.0.attn.qkv.weight"][:64]})  # a rank's half, tp=2
    with pytest.raises(ValueError, match=r"wrong shape: blocks\.0\.attn\.qkv\.weight \(64, 64\) \(expected \(128, 64\)\)"
                                         r"(.|\n)*full_state_dict"):
        hf_state_dict_from_llama(shard, config)
