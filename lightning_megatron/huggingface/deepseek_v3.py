"""Hugging Face ``DeepseekV3ForCausalLM`` <-> our GPT with multi-head latent attention and DeepSeek's MoE layers.

DeepSeek-V3 is a pre-norm RMSNorm/SwiGLU decoder whose attention is multi-head latent attention
(``GPTConfig.mla``: ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
``v_head_dim``; ``models.latent_attention``) and whose layers from ``first_k_dense_replace`` on are
Mixtures of Experts (``MoEConfig.layer_freq``, a 0/1 pattern): ``n_routed_experts`` SwiGLU experts
``moe_intermediate_size`` wide, ``num_experts_per_tok`` chosen per token by sigmoid scores plus the
score-correction bias (``e_score_correction_bias``, our ``expert_bias``: the aux-loss-free balancing's bias,
moved after each optimizer step in training) among the ``topk_group`` best of ``n_group`` groups
(``router_num_groups``/``router_group_topk``), their weights renormalised when ``norm_topk_prob`` and multiplied by
``routed_scaling_factor`` (``router_topk_scaling_factor``), plus ``n_shared_experts`` shared experts, which are one
shared expert ``n_shared_experts * moe_intermediate_size`` wide (``shared_expert_size``, ungated).

Rotary channels: with ``rope_interleave`` (transformers' default, DeepSeek's own layout) the rope channels of each
query head and of the shared key are rotated in adjacent pairs ``(2j, 2j + 1)``; ours rotate ``(j, j + r/2)``. The
rows of ``q_b_proj`` (``q_proj``) and ``kv_a_proj_with_mqa`` that make the rope channels are permuted on the way in
(evens, then odds) and back on the way out, which gives the same scores; an export writes ``rope_interleave: true``.

YaRN with DeepSeek's ``mscale``/``mscale_all_dim`` (the published model's ``rope_scaling``): the rotary part is
``RopeScaling``'s (the attention factor on ``cos``/``sin``); the softmax scale, which transformers'
DeepseekV3Attention multiplies by ``RopeScaling.softmax_scale_factor()``, is our ``softmax_scale``: set on the way
in (``MLAConfig.softmax_scale``: ``qk_head_dim ** -0.5`` times that factor; None when it is 1), required to be
that on the way out.

``num_key_value_heads`` is not read (latent attention makes every head's keys and values; transformers' class
defaults it to 128 whatever the heads): an export writes the query heads' count. Not modelled, so refused by name:
``rope_interleave=False`` checkpoints, ``attention_bias``, rotary types other than ours, ``mscale_all_dim`` with a
rotary type other than YaRN, an ``rms_norm_eps`` other than 1e-6 (transformers normalises the latents with 1e-6
whatever it says; ours with the model's one eps), and multi-token prediction layers (``num_nextn_predict_layers``
is read as absent: an export writes 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import torch
from torch import Tensor

from lightning_megatron.huggingface.family import Family
from lightning_megatron.huggingface.io import config_fields
from lightning_megatron.huggingface.llama import (DECODER_PIECES, TIED_WHY, UNEXPRESSED, ExpertNames, _gated_mlp_rules,
                                                  _rotary_from_hf, _rotary_to_hf, checkpoint_name)
from lightning_megatron.huggingface.llama import _moe_rules as llama_moe_rules
from lightning_megatron.huggingface.mapping import (Rule, Stacked, StateDictMapping, Texts, Tie, Transform,
                                                    check_extra_fields, pair, raise_problems, state_dict_shapes)
from lightning_megatron.models.gpt import GPT, GPTConfig, GPTModel
from lightning_megatron.models.latent_attention import MLAConfig
from lightning_megatron.models.moe import MoEConfig

ARCHITECTURE = "DeepseekV3ForCausalLM"
#: DeepseekV3Config's defaults of the fields read here (older configs leave out the fields at their defaults).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": None, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True,
    "attention_bias": False, "attention_dropout": 0.0}
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which its q_a and kv_a norms keep


@dataclass(frozen=True)
class InterleavedRope(Transform):
    """Rows of ``heads`` blocks of ``[nope | rope]`` (a query projection, or ``kv_a_proj_with_mqa``'s one block of
    the latent and the shared rotary key): the ``rope`` rows of each block in DeepSeek's adjacent-pair order
    (theirs) <-> evens then odds (ours, "rotate half"). Weights and 1-D biases alike."""

    heads: int
    nope: int
    rope: int

    def _permuted(self, tensor: Tensor, order: Tensor) -> Tensor:
        blocks = tensor.unflatten(0, (self.heads, self.nope + self.rope))
        rope = blocks[:, self.nope:].index_select(1, order)
        return torch.cat([blocks[:, :self.nope], rope], dim=1).flatten(0, 1)

    def _rotate_half_order(self) -> Tensor:
        """The interleaved rows (even, odd, even, ...) that make rotate-half's halves: evens first, then odds."""
        return torch.cat([torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2)])

    def to_ours(self, tensors: Sequence[Tensor]) -> Tensor:
        return self._permuted(tensors[0], self._rotate_half_order())

    def to_hf(self, tensor: Tensor) -> tuple[Tensor, ...]:
        return (self._permuted(tensor, torch.argsort(self._rotate_half_order())),)


# ----------------------------------------------------------------------------- configs
def config_from_hf(hf_config: Union[Mapping[str, Any], Any]) -> GPTConfig:
    """Our ``GPTConfig`` of a ``DeepseekV3Config`` (or its ``config.json`` fields); ``ValueError`` naming every field
    ours cannot compute."""
    fields = {**DEFAULTS, **config_fields(hf_config)}
    problems = []
    if fields.get("model_type", "deepseek_v3") != "deepseek_v3":
        problems.append(f"model_type={fields['model_type']!r}: this converts 'deepseek_v3' checkpoints")
    heads = fields["num_attention_heads"]
    refused = {"hidden_act": (fields["hidden_act"] != "silu", "our SwiGLU MLP gates with SiLU ('silu')"),
               "rope_interleave": (not fields["rope_interleave"], "converted checkpoints are DeepSeek's interleaved "
                                                                  "layout (true)"),
               "attention_bias": (bool(fields["attention_bias"]), "our latent attention has no biases (false)"),
               "rms_norm_eps": (fields["rms_norm_eps"] != LATENT_NORM_EPS,
                                f"transformers normalises the latents with {LATENT_NORM_EPS} whatever rms_norm_eps "
                                f"says, ours with one eps ({LATENT_NORM_EPS})"),
               "n_routed_experts": (not fields["n_routed_experts"], "our DeepSeek-V3 has MoE layers (a count)"),
               "n_shared_experts": (not fields["n_shared_experts"], "our DeepSeek-V3 has a shared expert (>= 1)")}
    problems += [f"{name}={fields[name]!r}: {why}" for name, (bad, why) in refused.items() if bad]
    rotary = _rotary_from_hf(fields, problems)
    rope = fields.get("rope_scaling") or fields.get("rope_parameters") or {}
    if rope.get("mscale_all_dim") and getattr(rotary.get("rope_scaling"), "rope_type", None) != "yarn":
        problems.append(f"mscale_all_dim={rope['mscale_all_dim']!r} with rope_type={rope.get('rope_type')!r}: "
                        f"ours scales the softmax by mscale_all_dim with YaRN only")
    raise_problems(problems, what=f"This Hugging Face config cannot be converted to our GPT ({ARCHITECTURE})")
    layers, dense = fields["num_hidden_layers"], min(fields["first_k_dense_replace"] or 0, fields["num_hidden_layers"])
    pattern = (0,) * dense + (1,) * (layers - dense)
    groups = fields["n_group"] or 1
    moe = MoEConfig(num_experts=fields["n_routed_experts"], top_k=fields["num_experts_per_tok"],
                    ffn_hidden_size=fields["moe_intermediate_size"], layer_freq=1 if all(pattern) else pattern,
                    score_function="sigmoid", normalize_topk=bool(fields["norm_topk_prob"]), expert_bias=True,
                    shared_expert_size=fields["n_shared_experts"] * fields["moe_intermediate_size"],
                    router_num_groups=None if groups == 1 else groups,
                    router_group_topk=None if groups == 1 else fields["topk_group"],
                    router_topk_scaling_factor=(None if fields["routed_scaling_factor"] == 1.0
                                                else float(fields["routed_scaling_factor"])))
    mla = MLAConfig(q_lora_rank=fields["q_lora_rank"], kv_lora_rank=fields["kv_lora_rank"],
                    qk_nope_head_dim=fields["qk_nope_head_dim"], qk_rope_head_dim=fields["qk_rope_head_dim"],
                    v_head_dim=fields["v_head_dim"])
    return GPTConfig(softmax_scale=mla.softmax_scale(rotary.get("rope_scaling")),
                     vocab_size=fields["vocab_size"], max_seq_length=fields["max_position_embeddings"],
                     hidden_size=fields["hidden_size"], num_layers=layers, num_heads=heads,
                     ffn_hidden_size=fields["intermediate_size"], dropout=0.0,
                     attention_dropout=float(fields["attention_dropout"]), layer_norm_eps=fields["rms_norm_eps"],
                     add_bias_linear=False, tie_embeddings=bool(fields["tie_word_embeddings"]), moe=moe, mla=mla,
                     **DECODER_PIECES, **rotary)


def _problems(config: GPTConfig) -> list[str]:
    """What of ``config`` a ``DeepseekV3ForCausalLM`` cannot hold."""
    problems = [f"{name}={getattr(config, name)!r} ({ARCHITECTURE} has {value!r})"
                for name, value in DECODER_PIECES.items() if getattr(config, name) != value]
    problems += [f"{name}={getattr(config, name)!r} ({ARCHITECTURE} has {default})"
                 for name, default in UNEXPRESSED.items()
                 if name not in ("mla", "softmax_scale") and getattr(config, name) is not None]
    expected = None if config.mla is None else config.mla.softmax_scale(config.rope_scaling)
    if config.mla is not None and config.softmax_scale != expected:
        problems.append(f"softmax_scale={config.softmax_scale!r}: {ARCHITECTURE}'s is qk_head_dim ** -0.5 times "
                        f"YaRN's mscale_all_dim factor, {expected!r} here (MLAConfig.softmax_scale)")
    if config.sliding_window is not None:
        problems.append(f"sliding_window={config.sliding_window}: {ARCHITECTURE} attends to every earlier token")
    if config.add_bias_linear:
        problems.append(f"add_bias_linear=True: {ARCHITECTURE} has no biases")
    if config.layer_norm_eps != LATENT_NORM_EPS:
        problems.append(f"layer_norm_eps={config.layer_norm_eps}: {ARCHITECTURE} normalises the latents with "
                        f"{LATENT_NORM_EPS}")
    if config.mla is None:
        problems.append(f"mla=None: {ARCHITECTURE}'s attention is multi-head latent attention")
    moe = config.moe
    if moe is None:
        return problems + [f"moe=None: {ARCHITECTURE}'s layers from first_k_dense_replace on are Mixtures of Experts"]
    moe_layers = [int(config.is_moe_layer(index)) for index in range(config.num_layers)]
    if moe_layers != sorted(moe_layers):
        problems.append(f"moe.layer_freq={moe.layer_freq!r}: {ARCHITECTURE}'s dense layers are the first ones "
                        f"(first_k_dense_replace)")
    if (moe.score_function, moe.expert_bias) != ("sigmoid", True):
        problems.append(f"moe.score_function={moe.score_function!r}, expert_bias={moe.expert_bias}: {ARCHITECTURE} "
                        f"routes by sigmoid scores with a score-correction bias ('sigmoid', True)")
    if moe.shared_expert_gate or not moe.shared_expert_size or moe.shared_expert_size % config.moe_ffn_size:
        problems.append(f"moe.shared_expert_size={moe.shared_expert_size}, shared_expert_gate="
                        f"{moe.shared_expert_gate}: {ARCHITECTURE}'s shared experts are ungated, a whole number "
                        f"(>= 1) of experts {config.moe_ffn_size} wide")
    return problems


def hf_config(config: GPTConfig, **extra_fields: Any) -> dict[str, Any]:
    """``config.json``'s fields of our ``config`` (``extra_fields``: e.g. token ids, as every family takes)."""
    raise_problems(_problems(config), what=f"This GPTConfig has no Hugging Face {ARCHITECTURE} equivalent",
                   fix="Models without latent attention export with model_type='llama', 'qwen2_moe', ...")
    moe, mla = config.moe, config.mla
    architecture = {
        "architectures": [ARCHITECTURE], "model_type": "deepseek_v3", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.ffn_size,
        "moe_intermediate_size": config.moe_ffn_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_heads,
        "n_shared_experts": moe.shared_expert_size // config.moe_ffn_size, "n_routed_experts": moe.num_experts,
        "routed_scaling_factor": moe.router_topk_scaling_factor or 1.0, "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank, "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "n_group": moe.router_num_groups or 1,
        "topk_group": moe.router_group_topk or 1, "num_experts_per_tok": moe.top_k,
        "first_k_dense_replace": sum(not config.is_moe_layer(index) for index in range(config.num_layers)),
        "norm_topk_prob": moe.normalize_topk, "hidden_act": "silu", "max_position_embeddings": config.max_seq_length,
        "rms_norm_eps": config.layer_norm_eps, "tie_word_embeddings": config.tie_embeddings,
        "rope_interleave": True, "attention_bias": False, "attention_dropout": config.attention_dropout,
        "num_nextn_predict_layers": 0, **_rotary_to_hf(config)}
    check_extra_fields(architecture, extra_fields, config=config)
    return {**architecture, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **extra_fields}


# ----------------------------------------------------------------------------- state dicts
def _attention_rules(mla: MLAConfig, heads: int) -> list[Rule]:
    ours, theirs = "blocks.{i}.attn", "model.layers.{i}.self_attn"
    queries = InterleavedRope(heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim)
    return [*pair(f"{ours}.q", f"{theirs}.q_proj", queries), *pair(f"{ours}.q_down", f"{theirs}.q_a_proj"),
            *pair(f"{ours}.q_down_norm", f"{theirs}.q_a_layernorm"), *pair(f"{ours}.q_up", f"{theirs}.q_b_proj", queries),
            *pair(f"{ours}.kv_down", f"{theirs}.kv_a_proj_with_mqa",
                  InterleavedRope(1, mla.kv_lora_rank, mla.qk_rope_head_dim)),
            *pair(f"{ours}.kv_down_norm", f"{theirs}.kv_a_layernorm"), *pair(f"{ours}.kv_up", f"{theirs}.kv_b_proj"),
            *pair(f"{ours}.proj", f"{theirs}.o_proj")]


def _moe_rules(config: GPTConfig) -> tuple[list[Rule], list[Stacked]]:
    """The Llama-shaped MoE layer's rules (its shared expert spelled ``shared_experts``) and the router's
    score-correction bias (our ``expert_bias``)."""
    rules, stacked = llama_moe_rules(config, ExpertNames("mlp", shared_expert_name="shared_experts"))
    bias = Rule("blocks.{i}.mlp.router.expert_bias", ("model.layers.{i}.mlp.gate.e_score_correction_bias",))
    return [*rules, bias], stacked


def mapping(config: GPTConfig) -> StateDictMapping:
    """Our ``GPTModel`` names <-> ``DeepseekV3ForCausalLM``'s, for ``config``."""
    raise_problems(_problems(config), what=f"This GPTConfig has no {ARCHITECTURE} equivalent")
    layer, tied = "model.layers.{i}", config.tie_embeddings
    moe_rules, stacked = _moe_rules(config)
    return StateDictMapping.build(
        state_dict_shapes(GPTModel, config), num_layers=config.num_layers,
        first=pair("embedding.wte", "model.embed_tokens"),
        layer=[*pair("blocks.{i}.ln_1", f"{layer}.input_layernorm"), *_attention_rules(config.mla, config.num_heads),
               *pair("blocks.{i}.ln_2", f"{layer}.post_attention_layernorm"),
               *_gated_mlp_rules("blocks.{i}.mlp", f"{layer}.mlp"), *moe_rules],
        last=pair("ln_f", "model.norm") + ([] if tied else pair("lm_head", "lm_head")),
        our_ties=[Tie("lm_head.weight", "embedding.wte.weight", TIED_WHY)] if tied else [],
        their_ties=[Tie("lm_head.weight", "model.embed_tokens.weight", TIED_WHY)] if tied else [],
        texts=Texts(hf=f"The Hugging Face {ARCHITECTURE} state dict", ours="The GPT state dict",
                    hf_fix="Pass the config that belongs to these weights (GPT.from_hf reads both from one directory)."),
        stacked=stacked)


FAMILY = Family(model_type="deepseek_v3", config_class=GPTConfig, lightning_module=GPT,
                config_from_hf=lambda fields, weight_names: config_from_hf(fields), hf_config=hf_config,
                mapping=mapping, hf_name=checkpoint_name, expected=f"a transformers {ARCHITECTURE}")
