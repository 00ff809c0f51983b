"""Hugging Face BERT conversion: masked-LM and sentence-order logits parity (padding masked) at tp=1, exact round
trips through from_pretrained, every weight file layout, the dispatch by model_type, and clear errors for what cannot
convert (pre-norm, unsupported switches, wrong shapes). The parallel layouts: ``test_hf_parity.py``."""

import sys

import pytest
import torch

from workers import hf_gpt2_setup
from workers.hf_bert_setup import HF_FIELDS, TOLERANCE, build_hf_model, sample_inputs
from lightning_megatron.huggingface.bert import (
    bert_config_from_hf,
    bert_state_dict_from_hf,
    hf_config_from_bert,
    hf_state_dict_from_bert,
    read_hf_bert,
)
from lightning_megatron.huggingface import lightning_module_for, read_hf, write_hf
from lightning_megatron.models import BERT, GPT, BERTConfig, GPTConfig

transformers = pytest.importorskip("transformers")
BOOKKEEPING = {"_name_or_path", "architectures", "dtype", "transformers_version"}


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model()


def outputs(model) -> tuple:
    """(masked-LM logits, sentence-order logits or None) of a transformers or our BERT on the sample inputs."""
    inputs = sample_inputs()
    with torch.no_grad():
        if isinstance(model, BERT):
            out = model(**inputs)
            return out.logits, out.binary_logits
        out = model(**inputs)
    return (out.prediction_logits, out.seq_relationship_logits) if hasattr(out, "prediction_logits") else (out.logits, None)


@pytest.mark.slow
@pytest.mark.parametrize("hf_class", ["BertForPreTraining", "BertForMaskedLM"])
def test_converted_model_matches_and_exports_back_exactly(hf_class, tmp_path):
    hf = build_hf_model(hf_class)
    bert = BERT.from_hf(hf, learning_rate=1e-4).eval()
    pre_training = hf_class == "BertForPreTraining"
    assert bert.config == BERTConfig(vocab_size=300, max_seq_length=48, type_vocab_size=3, hidden_size=64, num_layers=2,
                                     num_heads=4, ffn_hidden_size=96, layer_norm_eps=1e-12, norm_position="post",
                                     binary_head=pre_training)
    assert bert.hparams.learning_rate == 1e-4
    expected, got = outputs(hf), outputs(bert)
    deviations = [(g - e).abs().max().item() for g, e in zip(got, expected) if e is not None]
    print(f"{hf_class}: max |logit difference| {deviations} (logits up to {expected[0].abs().max():.1f})")
    assert len(deviations) == (2 if pre_training else 1) and max(deviations) <= TOLERANCE
    assert (got[1] is None) == (not pre_training)

    hf_state = hf.state_dict()
    back = hf_state_dict_from_bert(bert.model.state_dict(), bert.config)
    assert back.keys() == hf_state.keys()
    for name, value in hf_state.items():
        assert torch.equal(back[name], value), name

    bert.to_hf(tmp_path, pad_token_id=HF_FIELDS["pad_token_id"])
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors"}
    reloaded = getattr(transformers, hf_class).from_pretrained(tmp_path).eval()
    assert reloaded.config.architectures == [hf_class]
    differing = {k for k, v in hf.config.to_dict().items() if reloaded.config.to_dict().get(k) != v} - BOOKKEEPING
    assert not differing, differing
    for name, value in hf_state.items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    for again, first in zip(outputs(reloaded), expected):
        assert (again is None and first is None) or torch.equal(again, first)


@pytest.mark.slow
def test_tanh_gelu_converts_both_ways(tmp_path):
    hf = build_hf_model(hidden_act="gelu_new")  # the tanh approximation, as some BERT variants use
    bert = BERT.from_hf(hf).eval()
    assert bert.config.gelu_approximate == "tanh"
    deviations = [(g - e).abs().max().item() for g, e in zip(outputs(bert), outputs(hf))]
    assert max(deviations) <= TOLERANCE, deviations
    bert.to_hf(tmp_path)
    reloaded = transformers.BertForPreTraining.from_pretrained(tmp_path).eval()
    assert reloaded.config.hidden_act == "gelu_pytorch_tanh"  # torch's own op: what our model computes
    assert all(torch.equal(a, b) for a, b in zip(outputs(reloaded), outputs(bert)))


@pytest.mark.parametrize("layout", ["sharded safetensors", "pytorch_model.bin", "TensorFlow-era names"])
def test_reads_every_save_pretrained_layout_without_transformers(hf_model, layout, tmp_path, monkeypatch):
    if layout == "sharded safetensors":
        hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
    else:
        hf_model.config.save_pretrained(tmp_path)
        state = hf_model.state_dict()
        if layout == "TensorFlow-era names":  # as the original bert-base-uncased: gamma/beta, one decoder bias, buffers
            state = {name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): value
                     for name, value in state.items() if name != "cls.predictions.decoder.bias"}
            state["bert.embeddings.position_ids"] = torch.arange(HF_FIELDS["max_position_embeddings"])[None]
        torch.save(state, tmp_path / "pytorch_model.bin")
    monkeypatch.setitem(sys.modules, "transformers", None)  # directories never need it
    config, state_dict = read_hf_bert(tmp_path)
    expected = bert_state_dict_from_hf(hf_model.state_dict(), config)
    assert config.binary_head and state_dict.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state_dict[name], value), name


def test_read_hf_and_write_hf_dispatch_on_the_model_type(hf_model, tmp_path):
    gpt2 = hf_gpt2_setup.build_hf_model()
    hf_model.save_pretrained(tmp_path / "bert")
    gpt2.save_pretrained(tmp_path / "gpt2")
    for name, hf, config_class, module_class in [("bert", hf_model, BERTConfig, BERT), ("gpt2", gpt2, GPTConfig, GPT)]:
        config, state_dict = read_hf(tmp_path / name)
        assert type(config) is config_class and lightning_module_for(config) is module_class
        assert read_hf(hf)[0] == config  # a model object works the same
        module = lightning_module_for(config)(config)
        module.configure_model()
        module.model.load_state_dict(state_dict)
        assert state_dict.keys() == module.model.state_dict().keys()  # our model's names, no "model." prefix
        write_hf(tmp_path / f"{name}-out", config, module.state_dict())  # a LightningModule's state dict works too
        config_again, state_again = read_hf(tmp_path / f"{name}-out")
        assert config_again == config
        assert all(torch.equal(state_again[k], v) for k, v in state_dict.items())

    with pytest.raises(ValueError, match=r"model_type='bert' cannot be converted: supported .* 'gpt2', .*'llama', "
        r"'mistral', 'mixtral', .*'qwen3', 'qwen3_moe'\. It is a BERT model: read it with BERT\.from_hf"):
        GPT.from_hf(tmp_path / "bert")
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(ValueError, match=r"model_type='gpt_neox' cannot be converted: supported .* 'bert', 'deepseek_v3', 'gemma3_text', 'gpt2'"):
        read_hf(tmp_path / "bert")
    with pytest.raises(TypeError, match="Expected a GPTConfig or BERTConfig, got dict"):
        write_hf(tmp_path / "x", {}, {})


@pytest.mark.parametrize("field, value, message", [
    ("position_embedding_type", "relative_key", "position_embedding_type='relative_key': our BERT supports only 'absolute'"),
    ("is_decoder", True, "is_decoder=True"),
    ("add_cross_attention", True, "add_cross_attention=True"),
    ("tie_word_embeddings", False, "tie_word_embeddings=False"),
    ("hidden_act", "relu", "hidden_act='relu': our BERT uses a GELU"),
    ("model_type", "roberta", "only BERT"),
])
def test_unconvertible_config_raises(field, value, message):
    config = transformers.BertConfig(**HF_FIELDS).to_dict() | {field: value}
    with pytest.raises(ValueError, match=f"cannot be converted to our BERT(.|\n)*{message}"):
        bert_config_from_hf(config)


def test_pre_norm_bert_refuses_to_export(tmp_path):
    bert = BERT(BERTConfig(norm_position="pre"))
    bert.configure_model()
    fix = r"norm_position='pre': Hugging Face's BERT is post-norm.*BERTConfig\(norm_position='post'\)"
    with pytest.raises(ValueError, match=fix):
        bert.to_hf(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=fix):
        hf_config_from_bert(bert.config)
    with pytest.raises(ValueError, match=fix):
        hf_state_dict_from_bert(bert.model.state_dict(), bert.config)


def test_config_round_trips_and_json_defaults_fill_in():
    config = BERTConfig(vocab_size=1000, max_seq_length=128, type_vocab_size=4, hidden_size=96, num_heads=6, num_layers=3,
                        dropout=0.1, attention_dropout=0.05, layer_norm_eps=1e-6, norm_position="post",
                        gelu_approximate="tanh", binary_head=False)
    fields = hf_config_from_bert(config, pad_token_id=0)
    assert fields["intermediate_size"] == 384 and fields["architectures"] == ["BertForMaskedLM"]
    assert bert_config_from_hf(transformers.BertConfig(**fields)) == config
    assert bert_config_from_hf(fields, binary_head=True) == BERTConfig(**{**config.__dict__, "binary_head": True})
    assert bert_config_from_hf({"num_hidden_layers": 2}) == BERTConfig(  # BertConfig's defaults, pre-training heads
        vocab_size=30522, max_seq_length=512, hidden_size=768, num_layers=2, num_heads=12, dropout=0.1,
        attention_dropout=0.1, layer_norm_eps=1e-12, norm_position="post")
    with pytest.raises(ValueError, match=r"\['hidden_size'\] describe the architecture, which comes from the BERTConfig"):
        hf_config_from_bert(config, hidden_size=8)


def test_state_dicts_that_cannot_convert_raise(hf_model):
    config = bert_config_from_hf(hf_model.config)
    hf_state = hf_model.state_dict()
    untied = dict(hf_state, **{"cls.predictions.decoder.weight": torch.zeros(300, 64)})
    with pytest.raises(ValueError, match="decoder.weight differs from bert.embeddings.word_embeddings.weight.*ties them"):
        bert_state_dict_from_hf(untied, config)
    with pytest.raises(ValueError, match=r"wrong shape: bert\.embeddings\.position_embeddings\.weight \(48, 64\) "
                                         r"\(expected \(16, 64\)\)(.|\n)*bert_config_from_hf"):
        bert_state_dict_from_hf(hf_state, BERTConfig(**{**config.__dict__, "max_seq_length": 16}))
    bare = {name.removeprefix("bert."): value for name, value in hf_state.items() if name.startswith("bert.")}
    with pytest.raises(ValueError, match=r"missing: bert\.(.|\n)*a BertModel has no masked-LM head"):
        bert_state_dict_from_hf(bare, config)

    ours = bert_state_dict_from_hf(hf_state, config)
    shard = dict(ours, **{"blocks.0.attn.qkv.weight": ours["blocks.0.attn.qkv.weight"][:96]})  # one rank's half at tp=2
    with pytest.raises(ValueError, match=r"wrong shape: blocks\.0\.attn\.qkv\.weight \(96, 64\) \(expected \(192, 64\)\)"
                                         r"(.|\n)*full_state_dict"):
        hf_state_dict_from_bert(shard, config)
    stage = {name: value for name, value in ours.items() if not name.startswith("blocks.1.")}  # one pipeline stage
    with pytest.raises(ValueError, match=r"missing: blocks\.1\.attn\.proj\.bias"):
        hf_state_dict_from_bert(stage, config)


def test_directory_without_weights_raises(hf_model, tmp_path):
    hf_model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        BERT.from_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        BERT.from_hf(tmp_path / "elsewhere")
    with pytest.raises(TypeError, match="BertForPreTraining or BertForMaskedLM .* got BertConfig"):
        BERT.from_hf(hf_model.config)
