"""Hugging Face GPT-2 conversion: logits parity at tp=1, exact round trips, every weight file layout save_pretrained
writes, and clear errors for what cannot convert (the parallel layouts: ``test_hf_parity.py``)."""

import sys

import pytest
import torch

from workers.hf_gpt2_setup import HF_FIELDS, TOLERANCE, build_hf_model, sample_input_ids
from lightning_megatron.huggingface.gpt2 import (
    gpt_config_from_hf,
    gpt_state_dict_from_hf,
    hf_config_from_gpt,
    hf_state_dict_from_gpt,
    read_hf_gpt2,
)
from lightning_megatron.models import GPT, GPTConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model()


@pytest.fixture(scope="module")
def expected_logits(hf_model):
    with torch.no_grad():
        return hf_model(sample_input_ids()).logits


def test_converted_model_matches_and_exports_back_exactly(hf_model, expected_logits, tmp_path):
    gpt = GPT.from_hf(hf_model).eval()
    assert gpt.config == GPTConfig(vocab_size=300, max_seq_length=64, hidden_size=64, num_layers=2, num_heads=4)
    with torch.no_grad():
        deviation = (gpt(sample_input_ids()) - expected_logits).abs().max().item()
    print(f"tp=1: max |logit difference| {deviation:.2e} (logits up to {expected_logits.abs().max():.2f})")
    assert deviation <= TOLERANCE

    hf_state = hf_model.state_dict()
    back = hf_state_dict_from_gpt(gpt.model.state_dict(), gpt.config)
    assert back.keys() == hf_state.keys()
    for name, value in hf_state.items():
        assert torch.equal(back[name], value), name

    gpt.to_hf(tmp_path)
    assert {"config.json", "model.safetensors"} <= {p.name for p in tmp_path.iterdir()}
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    bookkeeping = {"_name_or_path", "architectures", "dtype", "transformers_version"}
    differing = {k for k, v in hf_model.config.to_dict().items() if reloaded.config.to_dict().get(k) != v} - bookkeeping
    assert not differing, differing
    for name, value in hf_state.items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    with torch.no_grad():
        assert torch.equal(reloaded(sample_input_ids()).logits, expected_logits)


@pytest.mark.parametrize("layout", ["sharded safetensors", "pytorch_model.bin", "GPT2Model names"])
def test_reads_every_save_pretrained_layout(hf_model, layout, tmp_path):
    if layout == "sharded safetensors":
        hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
    else:
        hf_model.config.save_pretrained(tmp_path)
        state = hf_model.state_dict()
        if layout == "GPT2Model names":  # as the original `gpt2` checkpoint: no prefix, causal-mask buffers, no head
            state = {name.removeprefix("transformer."): value for name, value in state.items() if name != "lm_head.weight"}
            state |= {f"h.{i}.attn.bias": torch.ones(1, 1, 64, 64).tril() for i in range(HF_FIELDS["n_layer"])}
        torch.save(state, tmp_path / "pytorch_model.bin")
    config, state_dict = read_hf_gpt2(tmp_path)
    expected = gpt_state_dict_from_hf(hf_model.state_dict(), config)
    assert state_dict.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state_dict[name], value), name


@pytest.mark.parametrize("field, value, message", [
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx=True"),
    ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn=True"),
    ("activation_function", "relu", "activation_function='relu'"),
    ("tie_word_embeddings", False, "tie_word_embeddings=False"),
    ("embd_pdrop", 0.2, "set them equal"),
    ("model_type", "llama", "only GPT-2"),
])
def test_unconvertible_config_raises(field, value, message):
    config = transformers.GPT2Config(**HF_FIELDS).to_dict() | {field: value}
    with pytest.raises(ValueError, match=f"cannot be converted(.|\n)*{message}"):
        gpt_config_from_hf(config)


def test_config_round_trips_and_json_defaults_fill_in():
    config = GPTConfig(vocab_size=50257, hidden_size=96, num_heads=6, num_layers=3, ffn_hidden_size=200, dropout=0.1,
                       attention_dropout=0.05, layer_norm_eps=1e-6)
    fields = hf_config_from_gpt(config, pad_token_id=0)
    assert gpt_config_from_hf(transformers.GPT2Config(**fields)) == config
    assert fields["eos_token_id"] == 50256 and fields["pad_token_id"] == 0
    assert gpt_config_from_hf({"n_layer": 2}) == GPTConfig(vocab_size=50257, max_seq_length=1024, hidden_size=768,
                                                           num_layers=2, num_heads=12, dropout=0.1, attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"\['n_embd'\] describe the architecture"):
        hf_config_from_gpt(config, n_embd=8)


def test_state_dicts_that_cannot_convert_raise(hf_model):
    config = gpt_config_from_hf(hf_model.config)
    untied = dict(hf_model.state_dict(), **{"lm_head.weight": torch.zeros(300, 64)})
    with pytest.raises(ValueError, match="ties them"):
        gpt_state_dict_from_hf(untied, config)
    ours = gpt_state_dict_from_hf(hf_model.state_dict(), config)
    shard = dict(ours, **{"blocks.0.attn.qkv.weight": ours["blocks.0.attn.qkv.weight"][:96]})  # one rank's half at tp=2
    with pytest.raises(ValueError, match=r"wrong shape: blocks\.0\.attn\.qkv\.weight \(96, 64\) \(expected \(192, 64\)\)"
                                         r"(.|\n)*full_state_dict"):
        hf_state_dict_from_gpt(shard, config)
    stage = {name: value for name, value in ours.items() if not name.startswith("blocks.1.")}  # one pipeline stage
    with pytest.raises(ValueError, match=r"missing: blocks\.1\.attn\.proj\.bias"):
        hf_state_dict_from_gpt(stage, config)


def test_directory_without_weights_raises(hf_model, tmp_path):
    hf_model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        GPT.from_hf(tmp_path)
    with pytest.raises(TypeError, match="got GPT2Config"):
        GPT.from_hf(hf_model.config)


def test_missing_safetensors_names_the_extra(hf_model, tmp_path, monkeypatch):
    gpt = GPT.from_hf(hf_model)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"pip install 'lightning-megatron\[hf\]'"):
        gpt.to_hf(tmp_path)
