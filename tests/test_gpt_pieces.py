"""The Llama-family pieces of GPTConfig in one process: presets, errors, attention's grouped-query path."""

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.models import GPT, GPTConfig, GPTModel
from lightning_megatron.models import attention as attention_module

# Parameter counts of the published models (their Hugging Face configs' shapes, counted by transformers).
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
             "mistral-7b": 7_248_023_552, "qwen2.5-7b": 7_615_616_512}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    config = GPTConfig.from_name(name)
    assert config.num_parameters() == PUBLISHED[name]
    with torch.device("meta"):
        gpt = GPT(name)
        gpt.configure_model()
    assert sum(p.numel() for p in gpt.parameters()) == PUBLISHED[name]


@pytest.mark.slow
def test_every_preset_counts_its_own_parameters():
    for name in GPTConfig.presets():
        with torch.device("meta"):
            model = GPTModel(GPTConfig.from_name(name))
        assert sum(p.numel() for p in model.parameters()) == GPTConfig.from_name(name).num_parameters(), name


@pytest.mark.parametrize("overrides, message", [
    (dict(num_heads=4, num_query_groups=3), r"num_heads=4 is not a multiple of num_query_groups=3.*\[1, 2, 4\]"),
    (dict(hidden_size=36, num_heads=4), r"head_dim = hidden_size / num_heads = 36 / 4 = 9 is odd"),
    (dict(normalization="BatchNorm"), r"normalization='BatchNorm' is not one of \('LayerNorm', 'RMSNorm', 'ZeroCenteredRMSNorm'\)"),
    (dict(activation="relu"), r"activation='relu' is not one of \('gelu', 'swiglu', 'geglu', 'clamped_swiglu'\)"),
    (dict(norm_position="post"), r"norm_position='post' is not one of \('pre', 'sandwich'\)"),
    (dict(embedding_multiplier=0.0), r"embedding_multiplier=0.0 must be a positive number, or None"),
    (dict(final_logit_softcapping=float("inf")), r"final_logit_softcapping=inf must be a positive number, or None"),
    (dict(position_embedding_type="alibi"), r"position_embedding_type='alibi' is not one of"),
])
def test_bad_llama_configs_name_the_numbers(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig.from_name("llama-tiny", **overrides)


@pytest.mark.parametrize("tp, ok", [(1, True), (2, True), (4, True), (8, False), (3, False)])
def test_tensor_parallel_sizes_against_query_groups(tp, ok):
    """2 groups of 2 query heads: tp 1 and 2 split the groups, tp 4 replicates each key/value head on 2 ranks,
    tp 8 would need more query heads than a group has, tp 3 neither divides nor is a multiple."""
    config = GPTConfig.from_name("llama-tiny", ffn_hidden_size=192)
    if ok:
        config.validate_tensor_parallel_size(tp)
    else:
        with pytest.raises(ValueError, match=rf"tensor_parallel_size={tp} .*Use a tensor_parallel_size in \[1, 2, 4\]"):
            config.validate_tensor_parallel_size(tp)


def test_grouped_query_attention_never_repeats_keys_and_values(monkeypatch):
    seen, sdpa = [], F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, **kwargs):
        seen.append((q.shape[1], k.shape[1], v.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", recording_sdpa)
    for groups in (2, 1):
        model = GPTModel(GPTConfig.from_name("llama-tiny", num_query_groups=groups))
        model(torch.randint(0, 257, (2, 16)))
        assert seen and all(entry == (4, groups, groups, True) for entry in seen), seen
        seen.clear()


def test_a_yaml_style_rope_scaling_dict_becomes_a_rope_scaling():
    config = GPTConfig.from_name("llama-3.1-8b", rope_scaling={"factor": 4.0})
    assert config.rope_scaling.factor == 4.0 and config.rope_scaling.original_max_position_embeddings == 8192
    with pytest.raises(ValueError, match="rope_scaling scales rotary frequencies"):
        GPTConfig(rope_scaling={"factor": 4.0})


def test_checkpoints_saved_before_the_llama_fields_still_name_their_config():
    """hyper_parameters of a GPT saved before GPTConfig grew the Llama fields hold only the old ones: they still
    convert (the new fields take their GPT-2 defaults), and a BERT config is still recognised by its own fields."""
    from dataclasses import asdict

    from lightning_megatron.checkpoint.open import model_config
    from lightning_megatron.models import BERTConfig

    old = {"vocab_size": 257, "max_seq_length": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
           "ffn_hidden_size": None, "dropout": 0.0, "attention_dropout": 0.0, "layer_norm_eps": 1e-5}
    assert model_config({"config": old}) == GPTConfig(**old)
    bert = BERTConfig.from_name("bert-tiny")
    assert model_config({"config": asdict(bert)}) == bert
    llama = GPTConfig.from_name("llama-3.1-8b")
    assert model_config({"config": asdict(llama)}) == llama


@pytest.mark.slow
def test_rotary_saves_no_cos_sin_and_its_backward_is_the_gradient():
    """The rotation keeps nothing for backward but the positions it was given (autograd's own product would keep
    the [S, head_dim] cos/sin in every layer, whole-sequence under tp + SP); its hand-written backward against
    finite differences (gradcheck), with default positions, per-document positions and Llama-3.1 scaling."""
    from lightning_megatron.models.rotary import RopeScaling, RotaryEmbedding

    rotary = RotaryEmbedding(8, base=100.0, scaling=RopeScaling(original_max_position_embeddings=4))
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [3, 4, 5, 6, 7, 8]])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rotary(q, k)
        rotary(q, k, positions)
    assert len(saved) == 1 and saved[0] is positions
    for given in (None, positions):
        assert torch.autograd.gradcheck(lambda q, k: rotary(q, k, given), (q, k))
