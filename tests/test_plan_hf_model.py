"""``lightning-megatron plan --model``: a Hugging Face directory's (or a bare config.json's) model planned from its sizes,
counted against the ``transformers`` model built from the same config.json (on the meta device), in one process."""

import re

import pytest
import torch
import transformers
import yaml

from lightning_megatron.commands.plan import main
from lightning_megatron.plan import GPUS, Planner, Workload
from lightning_megatron.plan.hf_model import hf_model

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
# Each family's config class, and the transformers modules whose parameters the Llama-shaped equivalent lacks:
# OLMo 2's q/k norms span the whole projection. Qwen3, Mixtral and Gemma 3 convert natively.
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32), ()),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2), ()),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, mlp_only_layers=[0]), ()),
    "phi3": (transformers.Phi3Config, dict(pad_token_id=0), ()),
    "olmo2": (transformers.Olmo2Config, dict(pad_token_id=0), ("q_norm", "k_norm")),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(head_dim=32), ()),
}


def transformers_model(directory):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_json_plans_the_parameters_of_the_transformers_model_it_describes(tmp_path, family, no_process_group):
    """The families we convert are read natively; the others as their Llama-shaped equivalent, whose parameters are
    transformers' but for the modules it does not hold (named per family above: a few gains per layer); the planner's
    own inventory counts the same (a vocabulary of a multiple of 128: no padding)."""
    config_class, extra, lacking = FAMILIES[family]
    config_class(**TINY, **extra).save_pretrained(tmp_path)
    model = hf_model(tmp_path / "config.json")
    assert model.model_type == family and model.native == (family in ("qwen3", "mixtral", "gemma3_text", "qwen3_moe"))
    theirs = transformers_model(tmp_path)
    not_held = sum(p.numel() for name, p in theirs.named_parameters() if name.split(".")[-2] in lacking)
    assert (not_held > 0) == bool(lacking)
    assert model.parameters() == sum(p.numel() for p in theirs.parameters()) - not_held
    planner = Planner(model.make_module, Workload(global_batch_size=2, seq_length=16), GPUS["a100"], world_size=1)
    assert planner.inventory(1).total_parameters == model.parameters()
    if not model.native:
        assert "planned as the Llama-shaped GPTConfig" in model.notes[0] and "num_key_value_heads=2" in model.notes[0]


def test_a_multimodal_configs_text_model_and_a_config_its_family_refuses_are_planned_as_equivalents(tmp_path):
    """Gemma 3's multimodal config plans its text_config's model (the same as the text model's own config.json);
    a Qwen3 config with biases on q, k, v and o (which our GPT cannot convert) plans as its equivalent, saying why."""
    text = dict(TINY, head_dim=32)
    transformers.Gemma3Config(text_config=text).save_pretrained(tmp_path / "multimodal")
    transformers.Gemma3TextConfig(**text).save_pretrained(tmp_path / "text")
    multimodal, alone = hf_model(tmp_path / "multimodal"), hf_model(tmp_path / "text")
    assert multimodal.model_type == "gemma3_text" and not multimodal.native
    assert multimodal.config == alone.config and multimodal.notes[1:] == alone.notes
    assert "gemma3: a multimodal model; its text model (text_config) planned, not its other towers (vision_config)" \
        in multimodal.notes[0]
    transformers.Qwen3Config(**TINY, head_dim=32, attention_bias=True).save_pretrained(tmp_path / "biased")
    biased = hf_model(tmp_path / "biased")
    assert not biased.native and biased.config.kv_channels == 32 and not biased.config.add_bias_linear
    assert re.match(r"qwen3 is a family we convert, but not this config \(.*attention_bias=True", biased.notes[0], re.S)
    assert "not modelled: attention_bias=True" in "\n".join(biased.notes)


def test_plan_model_prints_what_it_read_and_writes_a_config_of_the_pretrained_directory(tmp_path, capsys,
                                                                                         no_process_group):
    """``--model DIR`` (a Qwen3 directory) plans as ``--config`` does, says what it read and transformers' count, and
    ``--write-config`` writes ``GPT(pretrained=DIR)``, which ``--config`` plans to the same best layout."""
    transformers.Qwen3Config(**TINY, head_dim=32).save_pretrained(tmp_path / "qwen3")
    written = tmp_path / "best.yaml"
    arguments = ["--gpus", "2", "--seq-length", "32", "--global-batch-size", "4", "--top", "1"]
    main(["--model", str(tmp_path / "qwen3"), *arguments, "--write-config", str(written)])
    said = capsys.readouterr().out
    assert "qwen3: converted as GPT(pretrained=...) reads it (Qwen3ForCausalLM)" in said
    assert re.search(r"transformers' Qwen3ForCausalLM of this config: [\d,]+ parameters; .* \(the same\)", said), said
    config = yaml.safe_load(written.read_text())
    assert config["model"] == {"class_path": "lightning_megatron.models.GPT",
                               "init_args": {"pretrained": str(tmp_path / "qwen3")}}
    best = said.splitlines()[said.splitlines().index(next(l for l in said.splitlines() if l.startswith("#"))) + 2]
    main(["--config", str(written), *arguments])
    assert best.split()[1:4] == capsys.readouterr().out.splitlines()[-1].split()[1:4]


def test_plan_model_refuses_what_it_cannot_plan_by_name(tmp_path, capsys):
    """An encoder (no key/value heads), a classifier, an encoder-decoder, a Mixture-of-Experts family we do not convert,
    a missing batch or one longer than the model's positions, and a config to write for a model fit would not train
    from its weights: each refused by name."""
    cases = {"roberta": (transformers.RobertaConfig(), r"model_type='roberta' cannot be planned: it lacks "
                                                       r"num_key_value_heads"),
             "classifier": (transformers.Phi3Config(**TINY, pad_token_id=0,
                                                    architectures=["Phi3ForSequenceClassification"]),
                            r"architectures=\['Phi3ForSequenceClassification'\]: not a causal language model"),
             "t5": (transformers.T5Config(), r"lacks hidden_size, intermediate_size, num_hidden_layers.*"
                                             r"is_encoder_decoder=True"),
             "olmoe": (transformers.OlmoeConfig(**TINY, num_experts=4), r"num_experts=4: a Mixture-of-Experts model")}
    arguments = ["--gpus", "2", "--seq-length", "32", "--global-batch-size", "4"]
    for name, (config, message) in cases.items():
        config.save_pretrained(tmp_path / name)
        with pytest.raises(SystemExit, match=message):
            main(["--model", str(tmp_path / name), *arguments])
    transformers.Phi3Config(**TINY, pad_token_id=0).save_pretrained(tmp_path / "phi3")
    with pytest.raises(SystemExit, match=r"--write-config: .*phi3.* not a Hugging Face directory of a family we convert"):
        main(["--model", str(tmp_path / "phi3"), *arguments, "--write-config", str(tmp_path / "out.yaml")])
    with pytest.raises(SystemExit, match=r"--seq-length 128 exceeds the 64 positions of .*phi3"):
        main(["--model", str(tmp_path / "phi3"), "--seq-length", "128", "--global-batch-size", "4"])
    with pytest.raises(SystemExit, match=r"--model needs --global-batch-size and --seq-length"):
        main(["--model", str(tmp_path / "phi3"), "--gpus", "2"])
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "phi3"), "--config", "x.yaml", *arguments])
    assert "give one of --config" in capsys.readouterr().err
