"""Gemma 3's configs (``huggingface/gemma3.py``): every spelling transformers reads (per-layer-type ``rope_parameters``,
transformers 4's ``rope_theta``/``rope_local_base_freq``/``rope_scaling`` and ``sliding_window_pattern``, the class
defaults) gives one GPTConfig, the published presets count transformers' parameters, the family is chosen from our
config, what cannot convert is refused by name both ways, and a multimodal checkpoint is refused with the recipe for
its text model (run here). The random model's logits, exports, generation, PEFT export and layouts: the ``gemma3`` case
of ``workers/hf_llama_setup.py`` in ``test_hf_llama.py``, ``test_generation.py``, ``test_lora_export.py``,
``test_hf_export.py``, ``test_hf_parity.py`` and ``test_layout_invariance.py``."""

from dataclasses import replace

import pytest
import torch

from workers.hf_llama_setup import build_hf_model, sample_input_ids
from lightning_megatron.huggingface import family_for
from lightning_megatron.huggingface.gemma3 import gemma3_config_from_hf, hf_config_from_gemma3
from lightning_megatron.huggingface.llama import hf_config_from_llama
from lightning_megatron.models import GPT, GPTConfig, GPTModel, RopeScaling

transformers = pytest.importorskip("transformers")


def test_every_spelling_of_rotary_parameters_and_windows_reads_to_one_config():
    fields = build_hf_model("gemma3").config.to_dict()
    config = gemma3_config_from_hf(fields)
    assert (config.rotary_base, config.rope_scaling, config.rotary_base_local) == (
        10000.0, RopeScaling(factor=4.0, rope_type="linear"), 100.0)
    assert (config.softmax_scale, config.embedding_multiplier, config.final_logit_softcapping) == (20 ** -0.5, 8.0, 5.0)
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention")
    # transformers 4: the full layers' rope_theta and rope_scaling, the sliding layers' rope_local_base_freq; the
    # pattern (every 2nd layer full) instead of layer_types
    older = {key: value for key, value in fields.items() if key not in ("rope_parameters", "layer_types")} | {
        "rope_theta": 10000.0, "rope_local_base_freq": 100.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "sliding_window_pattern": 2}
    expected = replace(config, layer_types=("sliding_attention", "full_attention") * 2)
    assert gemma3_config_from_hf(older) == expected == gemma3_config_from_hf(transformers.Gemma3TextConfig(**older))
    # config.json of older transformers holds only what differs from Gemma3TextConfig's defaults
    defaults = gemma3_config_from_hf({"model_type": "gemma3_text"})
    assert defaults == gemma3_config_from_hf(transformers.Gemma3TextConfig())
    assert (defaults.rotary_base, defaults.rotary_base_local, defaults.sliding_window, defaults.softmax_scale) == (
        1e6, 1e4, 4096, None)  # query_pre_attn_scalar 256 = head_dim: the default scale


@pytest.mark.parametrize("preset", ["gemma-3-1b", "gemma-3-12b", "gemma-3-27b"])
def test_presets_count_the_parameters_of_transformers_model_and_read_back(preset):
    """The presets export configs transformers reads back to them, and count the parameters of its Gemma3ForCausalLM
    built on the meta device from them (tied embeddings; four norms a layer; q/k norms)."""
    config = GPTConfig.from_name(preset)
    assert family_for(config).model_type == "gemma3_text"  # the sandwich norms choose the family
    fields = hf_config_from_gemma3(config)
    hf_config = transformers.AutoConfig.for_model(**fields)
    assert gemma3_config_from_hf(hf_config) == config == gemma3_config_from_hf(fields)
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.Gemma3ForCausalLM(hf_config).parameters())
        built = sum(p.numel() for p in GPTModel(config).parameters())
    assert config.num_parameters() == expected == built
    assert expected == {"gemma-3-1b": 999_885_952, "gemma-3-12b": 11_766_034_176, "gemma-3-27b": 27_009_346_304}[preset]
    assert hf_config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]


@pytest.mark.parametrize("field, value, message", [
    ("hidden_activation", "gelu", "hidden_activation='gelu': our GeGLU MLP gates with tanh GELU"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0: transformers' Gemma3ForCausalLM does not soft-cap"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True: our GPT's attention is causal"),
    ("attention_bias", True, "attention_bias=True: Gemma 3 as published has no biases"),
    ("sliding_window", None, "sliding_window=None: transformers' Gemma3ForCausalLM always builds a sliding mask"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
     "our sliding layers scale no rotary frequencies"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
     r"rope_parameters\['full_attention'\]\.rope_type='dynamic'"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e6}, "Gemma 3's are per layer type"),
])
def test_unconvertible_config_raises(field, value, message):
    fields = build_hf_model("gemma3").config.to_dict() | {field: value}
    with pytest.raises(ValueError, match=f"cannot be converted to our GPT \\(Gemma3ForCausalLM\\)(.|\n)*{message}"):
        gemma3_config_from_hf(fields)


def test_exports_refuse_what_the_family_cannot_hold():
    gemma = GPTConfig.from_name("gemma-3-1b")
    with pytest.raises(ValueError, match="norm_position='sandwich' \\(LlamaForCausalLM has 'pre'\\)"):
        hf_config_from_llama(gemma)
    with pytest.raises(ValueError, match="normalization='RMSNorm' \\(Gemma3ForCausalLM has 'ZeroCenteredRMSNorm'\\)"):
        hf_config_from_gemma3(GPTConfig.from_name("llama-tiny"))
    with pytest.raises(ValueError, match="embedding_multiplier=2.0: Gemma3ForCausalLM scales its embeddings by "
                                         "sqrt\\(hidden_size\\) = 33.94"):
        hf_config_from_gemma3(replace(gemma, embedding_multiplier=2.0))
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 \\(Gemma3ForCausalLM has no soft-capping"):
        hf_config_from_gemma3(replace(gemma, attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match="sliding_window=None: transformers' Gemma3ForCausalLM always builds"):
        hf_config_from_gemma3(replace(gemma, sliding_window=None, layer_types=None))
    # softmax_scale read from an integer query_pre_attn_scalar writes that integer back
    assert hf_config_from_gemma3(GPTConfig.from_name("gemma-3-27b"))["query_pre_attn_scalar"] == 168


def test_a_multimodal_checkpoint_is_refused_with_the_recipe_for_its_text_model(tmp_path):
    """The recipe the error gives, run: the text model it saves converts, and computes the multimodal model's logits
    of a text-only input (without a final soft-cap, as published: transformers 5.25's multimodal class applies none)."""
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    text = {key: value for key, value in build_hf_model("gemma3").config.to_dict().items()
            if key not in ("architectures", "model_type", "transformers_version", "dtype")} | {
        "final_logit_softcapping": None}
    config = Gemma3Config(text_config=text, mm_tokens_per_image=1, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))
    torch.manual_seed(0)
    m = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in m.parameters():
            param.normal_(0.0, 0.2)
    m.save_pretrained(tmp_path / "multimodal")
    with pytest.raises(ValueError, match="model_type='gemma3' cannot be converted(.|\n)*Gemma3ForConditionalGeneration"
                                         "(.|\n)*text.save_pretrained\\(TEXT_DIR\\)"):
        GPT.from_hf(tmp_path / "multimodal")
    text_model = Gemma3ForCausalLM(m.config.text_config)  # the recipe
    text_model.model.load_state_dict(m.model.language_model.state_dict())
    text_model.lm_head.load_state_dict(m.lm_head.state_dict())
    text_model.save_pretrained(tmp_path / "text")
    gpt = GPT.from_hf(tmp_path / "text").eval()
    with torch.no_grad():
        expected = m(sample_input_ids()).logits
        assert (gpt(sample_input_ids()) - expected).abs().max() <= 1e-4
