"""Hugging Face Mixtral and Qwen2-MoE: logits parity at tp=1 and exact round trips through from_pretrained for every
case of ``workers/hf_llama_setup.MOE_CASES``; every spelling of the experts read (the per-expert tensors
``save_pretrained`` writes, the stacked ones ``transformers`` 5 holds in memory); config defaults; the family chosen
from our config; clear errors for what cannot convert. The tp=2 layouts: ``test_hf_parity.py``."""

import json
import math
from dataclasses import replace

import pytest
import torch

from workers.hf_llama_setup import MOE_CASES, MODEL_TYPES, TOLERANCE, build_hf_model, sample_input_ids
from lightning_megatron.cli import main as cli_main
from lightning_megatron.huggingface import FAMILIES, family_for
from lightning_megatron.huggingface.io import read_weights, safetensors_torch
from lightning_megatron.huggingface.mixtral import mixtral_config_from_hf
from lightning_megatron.huggingface.qwen2_moe import hf_config_from_qwen2_moe, qwen2_moe_config_from_hf
from lightning_megatron.huggingface.qwen3_moe import hf_config_from_qwen3_moe, qwen3_moe_config_from_hf
from lightning_megatron.models import GPT, GPTConfig
from lightning_megatron.models.moe import MoEConfig

transformers = pytest.importorskip("transformers")
BOOKKEEPING = {"_name_or_path", "architectures", "dtype", "transformers_version"}
STORED_EXPERT = {"mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight",  # how checkpoints name an expert
                 "qwen2-moe": "model.layers.1.mlp.experts.7.up_proj.weight",
                 "qwen2-moe-norm": "model.layers.2.mlp.experts.7.down_proj.weight",
                 "qwen3-moe": "model.layers.2.mlp.experts.7.gate_proj.weight",
                 "qwen3-moe-step": "model.layers.1.mlp.experts.7.up_proj.weight"}


def routed_experts(hf, input_ids) -> dict[int, set[int]]:
    """Per MoE layer, the experts ``hf`` routes some token of ``input_ids`` to."""
    chosen: dict[int, set[int]] = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda module, args, out, index=index: chosen.setdefault(index, set()).update(out[2].flatten().tolist()))
        for index, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        hf(input_ids)
    for hook in hooks:
        hook.remove()
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_converted_model_matches_and_exports_back_exactly(case, tmp_path):
    hf = build_hf_model(case)
    input_ids = sample_input_ids()
    routed = routed_experts(hf, input_ids)  # every expert takes tokens, so a wrong expert's mapping cannot hide
    assert routed and all(experts == set(range(hf.config.num_experts)) for experts in routed.values())
    with torch.no_grad():
        expected = hf(input_ids).logits
    gpt = GPT.from_hf(hf).eval()
    with torch.no_grad():
        deviation = (gpt(input_ids) - expected).abs().max().item()
    print(f"{case}: max |logit difference| {deviation:.2e} (logits up to {expected.abs().max():.2f})")
    assert deviation <= TOLERANCE

    family = FAMILIES[MODEL_TYPES[case]]
    stored = family.canonical_hf_state_dict(hf.state_dict(), gpt.config)  # one tensor per expert
    back = family.hf_state_dict(gpt.model.state_dict(), gpt.config)
    assert back.keys() == stored.keys() and STORED_EXPERT[case] in back
    assert all(torch.equal(back[name], value) for name, value in stored.items())

    gpt.to_hf(tmp_path)  # the family follows from the config
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors"}
    reloaded, info = type(hf).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert reloaded.config.model_type == MODEL_TYPES[case]
    differing = {k for k, v in hf.config.to_dict().items() if reloaded.config.to_dict().get(k) != v}
    assert not differing - BOOKKEEPING, differing
    assert reloaded.state_dict().keys() == hf.state_dict().keys()
    assert all(torch.equal(reloaded.state_dict()[name], value) for name, value in hf.state_dict().items())
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(input_ids).logits, expected)
    assert GPT.from_hf(tmp_path).config == gpt.config


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe"])
def test_reads_the_stored_and_the_stacked_experts_and_writes_what_save_pretrained_writes(case, tmp_path):
    hf = build_hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    saved = read_weights(tmp_path / "hf")
    assert STORED_EXPERT[case] in saved  # transformers 5.24 writes one tensor per expert
    stacked = tmp_path / "stacked"  # as transformers 5 holds them, which from_pretrained loads too
    stacked.mkdir()
    (stacked / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    safetensors_torch().save_file({name: value.contiguous() for name, value in hf.state_dict().items()
                                   if not (name == "lm_head.weight" and hf.config.tie_word_embeddings)},
                                  str(stacked / "model.safetensors"))
    assert not any(".experts.0." in name for name in read_weights(stacked))
    reference = GPT.from_hf(hf).model.state_dict()
    for source in (tmp_path / "hf", stacked):
        ours = GPT.from_hf(source).model.state_dict()
        assert ours.keys() == reference.keys() and all(torch.equal(ours[k], v) for k, v in reference.items()), source

    # through a training checkpoint and back, in shards: exactly the tensors save_pretrained wrote
    cli_main(["checkpoint", "convert", str(tmp_path / "hf"), str(tmp_path / "ours.ckpt")])
    cli_main(["checkpoint", "convert", str(tmp_path / "ours.ckpt"), str(tmp_path / "back"), "--max-shard-size", "40KB"])
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == MODEL_TYPES[case]
    back = read_weights(tmp_path / "back")
    assert back.keys() == saved.keys() and all(torch.equal(back[name], value) for name, value in saved.items())


def test_gate_and_up_of_an_expert_are_not_interchangeable():
    """The parity above sees the order of an expert's gate and up halves (and of the stacked tensor's halves)."""
    hf = build_hf_model("mixtral")
    state = hf.state_dict()
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    swapped = dict(state, **{"model.layers.1.mlp.experts.gate_up_proj": gate_up.roll(gate_up.shape[1] // 2, dims=1)})
    gpt = GPT.from_hf(hf).eval()
    family = family_for(gpt.config)
    gpt.model.load_state_dict(family.state_dict_from_hf(swapped, gpt.config))
    with torch.no_grad():
        assert (gpt(sample_input_ids()) - hf(sample_input_ids()).logits).abs().max() > 100 * TOLERANCE


def test_configs_read_json_defaults_and_map_the_routing():
    mixtral = mixtral_config_from_hf({"model_type": "mixtral", "num_hidden_layers": 2})
    assert mixtral == mixtral_config_from_hf(transformers.MixtralConfig(num_hidden_layers=2))
    assert (mixtral.rotary_base, mixtral.layer_norm_eps, mixtral.ffn_hidden_size, mixtral.num_query_groups) == (
        1e6, 1e-5, 14336, 8)
    assert mixtral.moe == MoEConfig(num_experts=8, top_k=2, score_function="softmax", normalize_topk=True,
                                    aux_loss_coeff=0.001)
    qwen = qwen2_moe_config_from_hf({"model_type": "qwen2_moe", "num_hidden_layers": 4})
    assert qwen == qwen2_moe_config_from_hf(transformers.Qwen2MoeConfig(num_hidden_layers=4))
    assert (qwen.add_qkv_bias, qwen.ffn_hidden_size, qwen.moe_ffn_size) == (True, 5632, 1408)
    assert qwen.moe == MoEConfig(num_experts=60, top_k=4, ffn_hidden_size=1408, normalize_topk=False,
                                 aux_loss_coeff=0.001, shared_expert_size=5632, shared_expert_gate=True)
    # which layers are MoE: (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    pattern = qwen2_moe_config_from_hf(build_hf_model("qwen2-moe", num_hidden_layers=6, mlp_only_layers=[3]).config)
    assert pattern.moe.layer_freq == (0, 1, 0, 0, 0, 1)
    assert hf_config_from_qwen2_moe(pattern)["mlp_only_layers"] == [0, 2, 3, 4]
    assert qwen2_moe_config_from_hf({"model_type": "qwen2_moe", "qkv_bias": False}).add_qkv_bias is False


@pytest.mark.parametrize("preset, published", [
    ("mixtral-8x7b", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336,
                      "router_aux_loss_coef": 0.02, "sliding_window": None}),
    ("qwen1.5-moe-a2.7b", {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                           "shared_expert_intermediate_size": 5632, "intermediate_size": 5632, "norm_topk_prob": False,
                           "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True}),
    ("qwen3-30b-a3b", {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "head_dim": 128,
                       "num_key_value_heads": 4, "norm_topk_prob": True, "decoder_sparse_step": 1,
                       "mlp_only_layers": [], "max_position_embeddings": 40960}),
])
def test_presets_export_the_published_configs(preset, published):
    config = GPTConfig.from_name(preset)
    family = family_for(config)
    hf_config = transformers.AutoConfig.for_model(**family.hf_config(config))
    assert {field: getattr(hf_config, field) for field in published} == published
    assert family.config_from_hf(hf_config, ()) == config


# Qwen/Qwen3-30B-A3B's config.json on the Hugging Face Hub (transformers 4.51's spelling: num_experts, rope_theta).
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
                 "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
                 "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
                 "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                 "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
                 "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
                 "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
                 "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
                 "use_sliding_window": False, "vocab_size": 151936}


def test_qwen3_moe_configs_read_the_published_config_both_expert_spellings_and_the_window():
    published = qwen3_moe_config_from_hf(QWEN3_30B_A3B)
    assert published == GPTConfig.from_name("qwen3-30b-a3b")
    # transformers 5 writes the expert count as num_local_experts (its attribute map), the Hub's files num_experts
    respelled = transformers.Qwen3MoeConfig(**{k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"},
                                            num_experts=128).to_dict()
    assert "num_local_experts" in respelled and "num_experts" not in respelled
    assert qwen3_moe_config_from_hf(respelled) == published
    assert qwen3_moe_config_from_hf({"model_type": "qwen3_moe", "num_hidden_layers": 4}) == qwen3_moe_config_from_hf(
        transformers.Qwen3MoeConfig(num_hidden_layers=4))
    # dense layers among MoE ones, as Qwen2-MoE: mlp_only_layers, else every decoder_sparse_step-th layer
    for dense, pattern, written in (([], (0, 1, 0, 1), (2, [])), ([1], (0, 0, 0, 1), (4, [])),
                                    ([3], (1, 1, 1, 0), (1, [3]))):
        step = 1 if dense == [3] else 2
        config = qwen3_moe_config_from_hf(build_hf_model("qwen3-moe", num_hidden_layers=4, decoder_sparse_step=step,
                                                         mlp_only_layers=dense).config)
        assert (config.moe.layer_freq, config.ffn_hidden_size, config.moe_ffn_size, config.kv_channels) == (
            pattern, 96, 24, 32)
        fields = hf_config_from_qwen3_moe(config)  # a decoder_sparse_step where one describes the pattern
        assert (fields["decoder_sparse_step"], fields["mlp_only_layers"]) == written
    # transformers 5 slides in every layer when use_sliding_window (max_window_layers ignored); so does an export
    windowed = qwen3_moe_config_from_hf({**QWEN3_30B_A3B, "use_sliding_window": True, "sliding_window": 8})
    assert (windowed.sliding_window, windowed.layer_types) == (8, None)
    fields = hf_config_from_qwen3_moe(windowed)
    assert (fields["use_sliding_window"], fields["sliding_window"], fields["max_window_layers"]) == (True, 8, 0)
    hf = transformers.Qwen3MoeConfig(**fields)
    assert hf.sliding_window == 8 and qwen3_moe_config_from_hf(hf) == windowed


# Qwen/Qwen3-235B-A22B's shape (its config.json): not a preset, whose every-preset tests would build its 12,032
# experts on the meta device.
QWEN3_235B_A22B = GPTConfig.from_name("qwen3-30b-a3b", hidden_size=4096, num_layers=94, num_heads=64,
                                      ffn_hidden_size=12288, moe=MoEConfig(num_experts=128, top_k=8,
                                                                           ffn_hidden_size=1536, aux_loss_coeff=1e-3))


@pytest.mark.parametrize("config, card", [(GPTConfig.from_name("qwen3-30b-a3b"), ("30.5", "3.3")),
                                          (QWEN3_235B_A22B, ("235", "22"))], ids=["30b-a3b", "235b-a22b"])
def test_qwen3_moe_shapes_count_the_parameters_of_transformers_model(config, card):
    """All and active parameters (``num_active_parameters``: the top-k experts of each MoE layer) equal those of
    transformers' Qwen3MoeForCausalLM built on the meta device from the exported config, active ones counted from its
    stacked experts; cut to the model cards' digits, their numbers (embedding and head counted; 30,532,122,624 and
    3,353,032,704, 235,093,634,560 and 22,190,763,520)."""
    hf_config = transformers.AutoConfig.for_model(**hf_config_from_qwen3_moe(config))
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(hf_config)
    expected = sum(p.numel() for p in hf.parameters())
    idle = sum((layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel())
               * (hf_config.num_experts - hf_config.num_experts_per_tok) // hf_config.num_experts
               for layer in hf.model.layers)
    assert (config.num_parameters(), config.num_active_parameters()) == (expected, expected - idle)
    digits = [len(number.partition(".")[2]) for number in card]
    assert [math.floor(count / 10 ** (9 - d)) / 10 ** d for count, d in zip((expected, expected - idle), digits)] == [
        float(number) for number in card]


def test_family_is_chosen_from_the_config_and_refuses_what_it_cannot_hold(tmp_path):
    mixtral = GPT.from_hf(build_hf_model("mixtral")).config
    qwen = GPT.from_hf(build_hf_model("qwen2-moe")).config
    qwen3 = GPTConfig.from_name("qwen3-30b-a3b")
    assert [family_for(config).model_type for config in (mixtral, qwen, qwen3)] == ["mixtral", "qwen2_moe", "qwen3_moe"]
    refusals = [
        (mixtral, "llama", "LlamaForCausalLM's MLPs are dense; MoE models export with model_type='mixtral'"),
        (GPTConfig.from_name("llama-tiny"), "mixtral", "moe=None: MixtralForCausalLM's MLPs are Mixtures of Experts"),
        (replace(mixtral, moe=replace(mixtral.moe, layer_freq=(1, 0))), "mixtral", r"layers \[1\] are dense"),
        (replace(mixtral, moe=replace(mixtral.moe, normalize_topk=False)), "mixtral", "normalize_topk=False"),
        (replace(mixtral, moe=replace(mixtral.moe, expert_bias=True)), "mixtral", "no per-expert bias"),
        (replace(mixtral, moe=replace(mixtral.moe, score_function="sigmoid")), "mixtral", "routes by softmax"),
        (qwen, "mixtral", "shared_expert_size=40: MixtralForCausalLM has no shared expert(.|\n)*'qwen2_moe'"),
        (mixtral, "qwen2_moe", "shared_expert_size=0, shared_expert_gate=False: every Qwen2MoeForCausalLM MoE layer"),
        (replace(qwen, add_bias_linear=True), "qwen2_moe", "add_bias_linear=True: Qwen2MoeForCausalLM has biases on q"),
        (qwen3, "mixtral", r"qk_layernorm=True \(MixtralForCausalLM has False\)"),
        (mixtral, "qwen3_moe", r"qk_layernorm=False \(Qwen3MoeForCausalLM has True\)"),
        (replace(qwen, qk_layernorm=True), "qwen3_moe", "shared_expert_size=40: Qwen3MoeForCausalLM has no shared "
                                                        "expert(.|\n)*'qwen2_moe'"),
        (replace(qwen3, add_qkv_bias=True), "qwen3_moe", "add_qkv_bias=True: Qwen3MoeForCausalLM as published has no"),
        (replace(qwen3, num_layers=2, sliding_window=8, layer_types=("sliding_attention", "full_attention")),
         "qwen3_moe", "every Qwen3MoeForCausalLM layer slides, or none does"),
    ]
    for config, model_type, message in refusals:
        with pytest.raises(ValueError, match=f"no Hugging Face [A-Za-z0-9]+ equivalent(.|\n)*{message}"):
            family_for(config, model_type).hf_config(config)
    # an export names the problem before the mapping finds tensors it cannot place, and writes nothing
    with pytest.raises(ValueError, match="no LlamaForCausalLM equivalent(.|\n)*LlamaForCausalLM's MLPs are dense"):
        GPT.from_hf(build_hf_model("mixtral")).to_hf(tmp_path / "llama", model_type="llama")
    with_dense_layer = GPT(refusals[2][0])
    with_dense_layer.configure_model()
    with pytest.raises(ValueError, match=r"layers \[1\] are dense"):
        with_dense_layer.to_hf(tmp_path / "dense", model_type="mixtral")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("case, field, value, message", [
    ("mixtral", "router_jitter_noise", 0.1, "router_jitter_noise=0.1: our router does not perturb its inputs"),
    ("mixtral", "hidden_act", "gelu", "hidden_act='gelu'"),
    ("qwen2-moe", "shared_expert_intermediate_size", 0, "shared_expert_intermediate_size=0"),
    ("qwen3-moe", "attention_bias", True, "attention_bias=True: Qwen3-MoE's biases on q, k, v and o"),
    ("qwen3-moe", "num_local_experts", 0, "num_experts=0: every layer is dense; read it as model_type='qwen3'"),
])
def test_unconvertible_config_raises(case, field, value, message):
    fields = build_hf_model(case).config.to_dict() | {field: value}
    with pytest.raises(ValueError, match=f"cannot be converted to our GPT(.|\n)*{message}"):
        FAMILIES[MODEL_TYPES[case]].config_from_hf(fields, ())


def test_sliding_window_converts_and_exports_back(tmp_path):
    gpt = GPT.from_hf(build_hf_model("mixtral", sliding_window=8))
    assert (gpt.config.sliding_window, gpt.config.layer_types, gpt.config.max_seq_length) == (8, None, 64)
    gpt.to_hf(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["sliding_window"] == 8


def test_state_dicts_that_cannot_convert_raise():
    hf = build_hf_model("mixtral")
    config = mixtral_config_from_hf(hf.config)
    family = family_for(config)
    three = dict(hf.state_dict())
    three["model.layers.0.mlp.experts.down_proj"] = three["model.layers.0.mlp.experts.down_proj"][:3]
    with pytest.raises(ValueError, match=r"MixtralForCausalLM state dict does not match the config:\n  - missing: "
                                         r"model\.layers\.0\.block_sparse_moe\.experts\.3\.w2\.weight"):
        family.state_dict_from_hf(three, config)
    ours = family.state_dict_from_hf(hf.state_dict(), config)
    shard = dict(ours, **{"blocks.0.mlp.experts.1.fc.weight": ours["blocks.0.mlp.experts.1.fc.weight"][:48]})
    with pytest.raises(ValueError, match=r"wrong shape: blocks\.0\.mlp\.experts\.1\.fc\.weight \(48, 64\) \(expected "
                                         r"\(96, 64\)\)(.|\n)*full_state_dict"):
        family.hf_state_dict(shard, config)
