"""Hugging Face's Llama-shaped decoders <-> our GPT with Llama's pieces; ``LlamaForCausalLM`` here.

``MistralForCausalLM`` (``mistral.py``) and ``Qwen2ForCausalLM`` (``qwen2.py``) are the same
architecture (RMSNorm, rotary positions, SwiGLU, grouped-query attention) and share this module's
mapping and configs: a ``Dialect`` declares only the config fields a family spells its own way
(which biases it has, a sliding window). The tensors differ in two ways: our ``qkv`` is one tensor
fused by query group where theirs are ``q_proj``/``k_proj``/``v_proj``, and our ``mlp.fc`` is
``[gate; up]`` where theirs are ``gate_proj``/``up_proj``. Rotary positions use the "rotate half"
convention on both sides, so ``q_proj``/``k_proj`` need no permutation. The Mixture-of-Experts families,
``MixtralForCausalLM`` (``mixtral.py``), ``Qwen2MoeForCausalLM`` (``qwen2_moe.py``) and ``Qwen3MoeForCausalLM``
(``qwen3_moe.py``), are dialects too: ``ExpertNames`` says how one spells an MoE layer, each expert converting
like a dense MLP.

A ``head_dim`` other than ``hidden_size / num_attention_heads`` converts to ``GPTConfig.kv_channels``, and a
family with per-head query and key norms (``Qwen3ForCausalLM``, ``qwen3.py``; ``Qwen3MoeForCausalLM``) to ``qk_layernorm``. A dialect may
also bring its own pieces, layer norms and rotary fields: ``Gemma3ForCausalLM`` (``gemma3.py``: four norms a layer,
GeGLU, rotary parameters per layer type).

Not modelled, so refused with the field named: activations other than SiLU, rotary types other than ``default``,
``llama3``, ``linear`` and ``yarn`` (``dynamic``, ``longrope``, YaRN's ``mscale``/``mscale_all_dim``, ...), partial
rotary embeddings, per-layer rotary parameters (but Gemma 3's).
A sliding window converts to ``GPTConfig.sliding_window`` (Mistral's and Mixtral's in every layer,
Qwen2's, Qwen3's and Qwen2-MoE's in the layers their ``layer_types`` name). Hidden dropout is not a field
of these families, so ``GPTConfig.dropout`` is not exported.

Example::

    gpt = GPT.from_hf("path/to/Llama-3.2-1B")          # a save_pretrained directory or a LlamaForCausalLM
    gpt.to_hf("exported")                               # loads with LlamaForCausalLM.from_pretrained("exported")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

from lightning_megatron.huggingface.family import Family
from lightning_megatron.huggingface.io import config_fields
from lightning_megatron.huggingface.mapping import (
    Chunks,
    QueryGroups,
    Rule,
    Stacked,
    StateDictMapping,
    Texts,
    Tie,
    check_extra_fields,
    pair,
    raise_problems,
    state_dict_shapes,
)
from lightning_megatron.models.gpt import GPT, GPTConfig, GPTModel
from lightning_megatron.models.rotary import RopeScaling

# Our GPTConfig's pieces that every Llama-shaped family has.
DECODER_PIECES = {"normalization": "RMSNorm", "position_embedding_type": "rope", "activation": "swiglu",
                  "norm_position": "pre", "embedding_multiplier": None, "final_logit_softcapping": None,
                  "add_attention_bias": False, "attention_sinks": False}
#: A ``Dialect.pieces`` value: the family's config field decides this piece (its ``read_fields`` reads it).
FROM_FIELDS = object()
ROTARY_TYPES = ("default", "llama3", "linear", "yarn")
DEFAULT_ROPE_THETA = 10000.0
TIED_WHY = "the config ties them (tie_word_embeddings=True)"
# What the fields the shared code reads default to in every family's config class (each dialect adds its own).
COMMON_DEFAULTS: dict[str, Any] = {"hidden_act": "silu", "num_key_value_heads": None, "head_dim": None,
                                   "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_dropout": 0.0}

Fields = Mapping[str, Any]
DENSE_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: GPTConfig attention pieces no Llama-shaped family's config holds, and what these families compute instead.
UNEXPRESSED = {"rotary_base_local": "one rotary base in every layer", "softmax_scale": "1 / sqrt(head_dim)",
               "attn_logit_softcapping": "no soft-capping", "mla": "grouped-query attention"}
#: Our layer norms -> a Llama-shaped layer's (a norm before attention and one before the MLP).
PRE_NORMS = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
#: What gates each of our gated MLPs, for the error naming a family's other activation.
GATES = {"swiglu": "our SwiGLU MLP gates with SiLU", "geglu": "our GeGLU MLP gates with tanh GELU"}


def checkpoint_name(name: str) -> Optional[str]:
    """Older checkpoints store each layer's rotary frequencies as a buffer: not a weight (we compute them)."""
    return None if name.endswith("rotary_emb.inv_freq") else name


@dataclass(frozen=True)
class ExpertNames:
    """How a Mixture-of-Experts family's checkpoints spell an MoE layer's MLP: the module holding it (``mlp``, or
    Mixtral's ``block_sparse_moe``) with the router (``gate``) and the experts (``experts.{e}``);
    ``projections``: an expert's gate, up and down projections (Mixtral's ``w1``, ``w3``, ``w2``);
    ``shared_expert``: every MoE layer also has a gated shared expert (Qwen2-MoE's ``shared_expert``, spelled
    like the experts, and ``shared_expert_gate``); ``router``: the router's module (GPT-OSS's ``router``);
    ``rules``: a family that stores its experts otherwise (GPT-OSS's stacked, interleaved ``gate_up_proj``) gives
    its own rules and stacked tensors of a layer's experts, ``rules(config) -> (rules, stacked)``;
    ``shared_expert_name``: the shared expert's module (DeepSeek-V3's ``shared_experts``)."""

    block: str
    projections: tuple[str, str, str] = DENSE_PROJECTIONS
    shared_expert: bool = False
    router: str = "gate"
    rules: Optional[Callable[[GPTConfig], tuple[list[Rule], list[Stacked]]]] = None
    shared_expert_name: str = "shared_expert"


@dataclass(frozen=True)
class Dialect:
    """What one Llama-shaped family spells its own way: its names, its config class's defaults (older
    ``transformers`` write only the fields that differ from them), and two functions between its own
    fields and our config's (each appends what it cannot express to ``problems``):

    * ``read_fields(hf_fields, problems)``: ``GPTConfig`` fields, e.g. ``{"add_qkv_bias": True}``;
    * ``write_fields(config, problems)``: ``config.json`` fields, e.g. ``{"attention_bias": False}``.

    A Mixture-of-Experts family also names its MoE layers (``experts``) and may rename the names of its
    models' state dicts to its checkpoints' (``hf_name``, see ``Family``). ``qk_norm``: every layer normalises
    its query and key heads (``self_attn.q_norm``/``k_norm``, Qwen3's); ``head_dim``: the config class has a
    ``head_dim`` field (Qwen2's has not: its heads are ``hidden_size / num_attention_heads`` wide).

    A family whose layers differ from Llama's in more than names (Gemma 3's, ``gemma3.py``) also says:
    ``pieces``, our ``GPTConfig`` pieces every model of the family has; ``unexpressed``, the optional pieces its
    config cannot hold (and what it computes instead); ``activation``, ``config.json``'s activation field and its
    one value; ``norms``, our layer norms -> its layer's; ``rotary_from_hf``/``rotary_to_hf``, its rotary fields.
    A piece's value may be ``FROM_FIELDS``: the family's config field decides it, and ``read_fields`` reads it
    (GPT-OSS's ``add_attention_bias``).
    """

    model_type: str
    architecture: str
    defaults: Fields
    read_fields: Callable[[Fields, list[str]], dict[str, Any]]
    write_fields: Callable[[GPTConfig, list[str]], dict[str, Any]]
    experts: Optional[ExpertNames] = None
    hf_name: Callable[[str], Optional[str]] = checkpoint_name
    qk_norm: bool = False
    head_dim: bool = True
    pieces: Fields = dataclasses.field(default_factory=lambda: DECODER_PIECES)
    unexpressed: Fields = dataclasses.field(default_factory=lambda: UNEXPRESSED)
    activation: tuple[str, str] = ("hidden_act", "silu")
    norms: Fields = dataclasses.field(default_factory=lambda: PRE_NORMS)
    # One rotary embedding in every layer (the functions are defined below)
    rotary_from_hf: Callable[[Fields, list[str]], dict[str, Any]] = lambda fields, problems: _rotary_from_hf(
        fields, problems)
    rotary_to_hf: Callable[[GPTConfig], dict[str, Any]] = lambda config: _rotary_to_hf(config)

    def config_from_hf(self, hf_config: Union[Fields, Any]) -> GPTConfig:
        """Our ``GPTConfig`` for this family's config (a ``transformers`` config, its ``to_dict()``, or a parsed
        ``config.json``). Raises ``ValueError`` naming every field that describes a model ours cannot compute."""
        fields = {**COMMON_DEFAULTS, **self.defaults, **config_fields(hf_config)}
        problems = []
        if fields.get("model_type", self.model_type) != self.model_type:
            problems.append(f"model_type={fields['model_type']!r}: this converts {self.model_type!r} checkpoints")
        activation, gate = self.activation
        if fields[activation] != gate:
            problems.append(f"{activation}={fields[activation]!r}: {GATES[self.pieces['activation']]} ({gate!r})")
        hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
        head_dim = fields["head_dim"] or hidden // heads
        groups = fields["num_key_value_heads"] or heads
        pieces = {**self.rotary_from_hf(fields, problems), **self.read_fields(fields, problems)}
        raise_problems(problems, what=f"This Hugging Face config cannot be converted to our GPT ({self.architecture})")
        return GPTConfig(**{
            "vocab_size": fields["vocab_size"], "max_seq_length": fields["max_position_embeddings"],
            "hidden_size": hidden, "num_layers": fields["num_hidden_layers"], "num_heads": heads,
            "ffn_hidden_size": fields["intermediate_size"], "dropout": 0.0,  # explicit, as SwiGLU presets state it
            "attention_dropout": float(fields["attention_dropout"]), "layer_norm_eps": fields["rms_norm_eps"],
            "num_query_groups": None if groups == heads else groups, "add_bias_linear": False,
            "tie_embeddings": bool(fields["tie_word_embeddings"]), "qk_layernorm": self.qk_norm,
            "kv_channels": None if head_dim * heads == hidden else head_dim,
            **{name: value for name, value in self.pieces.items() if value is not FROM_FIELDS}, **pieces})

    def hf_config(self, config: GPTConfig, **extra_fields: Any) -> dict[str, Any]:
        """The ``config.json`` fields (``transformers.AutoConfig.for_model(**fields)``) of our ``config``.

        ``extra_fields`` adds fields that do not describe the architecture, e.g. your tokenizer's
        ``bos_token_id``/``eos_token_id``/``pad_token_id`` (``None`` by default). Rotary settings are
        written in both spellings: ``rope_parameters`` (transformers 5) and ``rope_theta``/``rope_scaling``
        (transformers 4).
        """
        problems = _decoder_problems(config, self)
        if not self.head_dim and config.head_dim * config.num_heads != config.hidden_size:
            problems.append(f"kv_channels={config.kv_channels}: {self.architecture}'s heads are hidden_size / "
                            f"num_heads = {config.hidden_size} / {config.num_heads} channels wide; export with "
                            f"model_type='llama' or 'mistral' (a head_dim field)")
        own = self.write_fields(config, problems)
        raise_problems(problems, what=f"This GPTConfig has no Hugging Face {self.architecture} equivalent",
                       fix=f"Configs with LayerNorm, learned positions and GELU export as 'gpt2'. The Llama-shaped "
                           f"families are {', '.join(repr(name) for name in DIALECT_NAMES)}.")
        architecture = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.query_groups,
            self.activation[0]: self.activation[1],
            "max_position_embeddings": config.max_seq_length,
            "rms_norm_eps": config.layer_norm_eps,
            "tie_word_embeddings": config.tie_embeddings,
            "attention_dropout": config.attention_dropout,
            **({"head_dim": config.head_dim} if config.kv_channels else {}),
            **self.rotary_to_hf(config),
            **own,
        }
        check_extra_fields(architecture, extra_fields, config=config)
        return {**architecture, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **extra_fields}

    def family(self) -> Family:
        return Family(model_type=self.model_type, config_class=GPTConfig, lightning_module=GPT,
                      config_from_hf=lambda fields, weight_names: self.config_from_hf(fields),
                      hf_config=self.hf_config,
                      mapping=lambda config: decoder_mapping(config, self),
                      hf_name=self.hf_name, expected=f"a transformers {self.architecture}")


DIALECT_NAMES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma3_text", "gpt_oss")


# ----------------------------------------------------------------------------- shared config pieces
def _decoder_problems(config: GPTConfig, dialect: Dialect) -> list[str]:
    architecture = dialect.architecture
    problems = [f"{name}={getattr(config, name)!r} ({architecture} has {value!r})"
                for name, value in {**dialect.pieces, "qk_layernorm": dialect.qk_norm}.items()
                if value is not FROM_FIELDS and getattr(config, name) != value]
    problems += [f"{name}={getattr(config, name)!r} ({architecture} has {default})"
                 for name, default in dialect.unexpressed.items() if getattr(config, name) is not None]
    return problems + _moe_problems(config, architecture, dialect.experts)


def _moe_problems(config: GPTConfig, architecture: str, experts: Optional[ExpertNames]) -> list[str]:
    """What a family with (``experts``) or without Mixture-of-Experts layers cannot hold: checked before the
    mapping is built, since most of it changes the tensors."""
    moe = config.moe
    if experts is None:
        return [] if moe is None else [f"moe=MoEConfig(num_experts={moe.num_experts}, ...): {architecture}'s MLPs "
                                       f"are dense; MoE models export with model_type='mixtral', 'qwen2_moe' or "
                                       f"'qwen3_moe'"]
    if moe is None:
        return [f"moe=None: {architecture}'s MLPs are Mixtures of Experts; dense models export with "
                f"model_type='llama', 'mistral' or 'qwen2'"]
    problems = []
    if moe.score_function != "softmax":
        problems.append(f"moe.score_function={moe.score_function!r}: {architecture} routes by softmax scores")
    if moe.expert_bias:
        problems.append(f"moe.expert_bias=True: {architecture}'s router has no per-expert bias")
    shared = (moe.shared_expert_size, moe.shared_expert_gate)
    if experts.shared_expert and not all(shared):
        problems.append(f"moe.shared_expert_size={shared[0]}, shared_expert_gate={shared[1]}: every {architecture} MoE "
                        f"layer has a gated shared expert")
    if not experts.shared_expert and any(shared):
        problems.append(f"moe.shared_expert_size={shared[0]}: {architecture} has no shared expert; export with "
                        f"model_type='qwen2_moe' (a gated one)")
    return problems


def _rotary_from_hf(fields: Fields, problems: list[str]) -> dict[str, Any]:
    """``rotary_base`` and ``rope_scaling`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (transformers 4; it wins when both are there, as in transformers)."""
    field = "rope_scaling" if fields.get("rope_scaling") else "rope_parameters"
    rope = dict(fields.get(field) or {})
    if any(isinstance(value, dict) for value in rope.values()):
        problems.append(f"{field}={rope!r}: rotary parameters per layer type; our layers share one rotary embedding")
        return {}
    return rotary_parameters(rope, field, fields, problems)


def rotary_parameters(rope: Fields, field: str, fields: Fields, problems: list[str]) -> dict[str, Any]:
    """``rotary_base`` and ``rope_scaling`` of one set of rotary parameters ``rope`` (``field`` names it in errors;
    ``fields``: the config's, for what ``rope`` leaves out)."""
    theta = float(rope.get("rope_theta", fields.get("rope_theta", DEFAULT_ROPE_THETA)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", fields.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        problems.append(f"partial_rotary_factor={partial}: our rotary embedding rotates every channel of a head (1.0)")
    if kind not in ROTARY_TYPES:
        problems.append(f"{field}.rope_type={kind!r}: our rotary embedding computes {', '.join(ROTARY_TYPES)} "
                        f"frequencies only")
        return {}
    if kind == "default":
        return {"rotary_base": theta}
    if kind == "linear":
        return {"rotary_base": theta, "rope_scaling": RopeScaling(factor=float(rope["factor"]), rope_type="linear")}
    if kind == "yarn":
        return {"rotary_base": theta, "rope_scaling": _yarn_from_hf(rope, fields)}
    missing = [key for key in ("factor", "low_freq_factor", "high_freq_factor") if key not in rope]
    if missing:
        problems.append(f"{field} of rope_type 'llama3' lacks {', '.join(missing)}")
        return {}
    return {"rotary_base": theta, "rope_scaling": RopeScaling(
        factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings",
                                                      fields["max_position_embeddings"])))}


def _yarn_from_hf(rope: Fields, fields: Fields) -> RopeScaling:
    """transformers' ``yarn`` parameters (its defaults: ``beta_fast`` 32, ``beta_slow`` 1, ``truncate`` True, the
    attention factor from ``factor`` and DeepSeek's ``mscale``/``mscale_all_dim``, which are kept as given: only
    DeepSeek's attention also scales its softmax by them, which its converter reads)."""
    mscales = {key: None if rope.get(key) is None else float(rope[key]) for key in ("mscale", "mscale_all_dim")}
    original = int(rope.get("original_max_position_embeddings") or fields["max_position_embeddings"])
    factor = rope.get("factor") or fields["max_position_embeddings"] / original
    attention_factor = rope.get("attention_factor")
    return RopeScaling(rope_type="yarn", factor=float(factor), original_max_position_embeddings=original,
                       beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                       truncate=bool(rope.get("truncate", True)),
                       attention_factor=None if attention_factor is None else float(attention_factor), **mscales)


def _rotary_to_hf(config: GPTConfig) -> dict[str, Any]:
    scaling = None if config.rope_scaling is None else config.rope_scaling.hf_parameters()
    parameters = {"rope_type": "default", "rope_theta": config.rotary_base, **(scaling or {})}
    return {"rope_parameters": parameters, "rope_theta": config.rotary_base, "rope_scaling": scaling}


def window_of_every_layer(fields: Fields) -> dict[str, Any]:
    """Mistral's and Mixtral's ``sliding_window``: every layer slides (None: none does)."""
    window = fields["sliding_window"]
    return {} if window is None else {"sliding_window": int(window)}


def dense_layer_problems(config: GPTConfig, family: str) -> list[str]:
    """A family whose every layer is a Mixture of Experts (Mixtral, GPT-OSS) cannot hold our dense layers."""
    dense = [index for index in range(config.num_layers) if not config.is_moe_layer(index)]
    return [f"moe.layer_freq={config.moe.layer_freq!r}: every {family} layer is a Mixture of Experts (layers {dense} "
            f"are dense)"] if dense else []


def window_to_every_layer(config: GPTConfig, architecture: str, problems: list[str]) -> dict[str, Any]:
    """``config.json``'s ``sliding_window`` of a family whose layers all slide or none (Mistral, Mixtral)."""
    if config.layer_types is not None:
        problems.append(f"layer_types={list(config.layer_types)}: every {architecture} layer slides, or none does; "
                        f"export with model_type='qwen2' (a window per layer type)")
    return {"sliding_window": config.sliding_window}


def windows_by_layer_type(fields: Fields) -> dict[str, Any]:
    """Qwen2's, Qwen3's and Qwen2-MoE's window: ``sliding_window`` when ``use_sliding_window``, in the layers its
    ``layer_types`` name (transformers 5), else in those from ``max_window_layers`` on (as transformers fills
    ``layer_types`` in)."""
    window = fields["sliding_window"] if fields["use_sliding_window"] else None
    if window is None:
        return {}
    types = fields.get("layer_types") or ["sliding_attention" if index >= fields["max_window_layers"]
                                          else "full_attention" for index in range(fields["num_hidden_layers"])]
    return {"sliding_window": int(window), "layer_types": tuple(types)}


def windows_to_layer_types(config: GPTConfig) -> dict[str, Any]:
    """``config.json``'s window fields for :func:`windows_by_layer_type`'s families: ``layer_types`` in full, and
    ``max_window_layers`` the first sliding layer (which transformers 4 reads)."""
    if config.sliding_window is None:
        return {"use_sliding_window": False, "sliding_window": None}
    types = [config.attention_type(index) for index in range(config.num_layers)]
    first = types.index("sliding_attention") if "sliding_attention" in types else config.num_layers
    return {"use_sliding_window": True, "sliding_window": config.sliding_window, "max_window_layers": first,
            "layer_types": types}


# ----------------------------------------------------------------------------- the Llama dialect
def _llama_fields(fields: Fields, problems: list[str]) -> dict[str, Any]:
    attention, mlp = bool(fields["attention_bias"]), bool(fields["mlp_bias"])
    if attention != mlp:
        problems.append(f"attention_bias={attention} with mlp_bias={mlp}: our GPT has biases on every linear layer "
                        f"(add_bias_linear) or on qkv alone (add_qkv_bias), not on attention or the MLP alone")
    return {"add_bias_linear": attention}


def _llama_hf_fields(config: GPTConfig, problems: list[str]) -> dict[str, Any]:
    if config.sliding_window is not None:
        problems.append(f"sliding_window={config.sliding_window}: LlamaForCausalLM attends to every earlier token; "
                        f"export with model_type='mistral' (every layer sliding) or 'qwen2' (per layer type)")
    if config.add_qkv_bias and not config.add_bias_linear:
        problems.append("add_qkv_bias=True without add_bias_linear: Llama's attention_bias puts biases on q, k, v and "
                        "o together; export with model_type='qwen2' (biases on q, k and v only)")
    return {"head_dim": config.head_dim, "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear}


LLAMA = Dialect(
    model_type="llama", architecture="LlamaForCausalLM",
    defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    read_fields=_llama_fields, write_fields=_llama_hf_fields)


# ----------------------------------------------------------------------------- state dicts (every dialect)
def _gated_mlp_rules(ours: str, theirs: str, projections: tuple[str, str, str] = DENSE_PROJECTIONS) -> list[Rule]:
    """Our ``GatedMLP`` (``fc`` = ``[gate; up]``, ``proj``) at ``ours`` <-> three projections at ``theirs``."""
    gate, up, down = projections
    return [*pair(f"{ours}.fc", [f"{theirs}.{gate}", f"{theirs}.{up}"], Chunks(2)),
            *pair(f"{ours}.proj", f"{theirs}.{down}")]


def _moe_rules(config: GPTConfig, names: ExpertNames) -> tuple[list[Rule], list[Stacked]]:
    """An MoE layer's rules, and the tensors ``transformers`` 5 stacks in memory. A layer's rules are expanded for
    every layer and skipped where our model lacks the name, so dense and MoE layers can alternate."""
    block = "model.layers.{i}." + names.block
    rules = pair("blocks.{i}.mlp.router", f"{block}.{names.router}")
    if names.rules is not None:
        own, stacked = names.rules(config)
        return rules + own, stacked
    for index in range(config.moe.num_experts):
        rules += _gated_mlp_rules(f"blocks.{{i}}.mlp.experts.{index}", f"{block}.experts.{index}", names.projections)
    rules += _gated_mlp_rules("blocks.{i}.mlp.shared_expert", f"{block}.{names.shared_expert_name}", names.projections)
    rules += pair("blocks.{i}.mlp.shared_expert_gate", f"{block}.shared_expert_gate")
    gate, up, down = (f"{block}.experts.{{e}}.{name}.weight" for name in names.projections)
    return rules, [Stacked(f"{block}.experts.gate_up_proj", (gate, up)), Stacked(f"{block}.experts.down_proj", (down,))]


def decoder_mapping(config: GPTConfig, dialect: Optional[Dialect] = None) -> StateDictMapping:
    """Our ``GPTModel`` names <-> those of a Llama-shaped ``...ForCausalLM`` (``dialect``'s, by default Llama's: its
    ``experts``, how a Mixture-of-Experts family names its MoE layers; ``qk_norm``, its query and key norms;
    ``norms``, its layer norms)."""
    dialect = dialect or LLAMA
    architecture, experts = dialect.architecture, dialect.experts
    raise_problems(_decoder_problems(config, dialect), what=f"This GPTConfig has no {architecture} equivalent")
    layer = "model.layers.{i}"
    tied = config.tie_embeddings
    moe_rules, stacked = _moe_rules(config, experts) if experts is not None else ([], [])
    return StateDictMapping.build(
        state_dict_shapes(GPTModel, config), num_layers=config.num_layers,
        first=pair("embedding.wte", "model.embed_tokens"),
        layer=[*[rule for ours, theirs in dialect.norms.items() for rule in pair(f"blocks.{{i}}.{ours}", f"{layer}.{theirs}")],
               *pair("blocks.{i}.attn.qkv", [f"{layer}.self_attn.{name}_proj" for name in "qkv"],
                     QueryGroups(config.num_heads, config.query_groups)),
               *pair("blocks.{i}.attn.proj", f"{layer}.self_attn.o_proj"),
               Rule("blocks.{i}.attn.sinks", (f"{layer}.self_attn.sinks",)),
               *[rule for norm in ("q_norm", "k_norm") if dialect.qk_norm
                 for rule in pair(f"blocks.{{i}}.attn.{norm}", f"{layer}.self_attn.{norm}")],
               *_gated_mlp_rules("blocks.{i}.mlp", f"{layer}.mlp"), *moe_rules],
        last=pair("ln_f", "model.norm") + ([] if tied else pair("lm_head", "lm_head")),
        our_ties=[Tie("lm_head.weight", "embedding.wte.weight", TIED_WHY)] if tied else [],
        their_ties=[Tie("lm_head.weight", "model.embed_tokens.weight", TIED_WHY)] if tied else [],
        texts=Texts(hf=f"The Hugging Face {architecture} state dict", ours="The GPT state dict",
                    hf_fix="Pass the config that belongs to these weights (GPT.from_hf reads both from one directory)."),
        stacked=stacked,
    )


FAMILY = LLAMA.family()

# The functional API: configs and full (unsharded) state dicts, the same for every Llama-shaped dialect.
llama_config_from_hf = LLAMA.config_from_hf
hf_config_from_llama = LLAMA.hf_config
llama_state_dict_from_hf = FAMILY.state_dict_from_hf
hf_state_dict_from_llama = FAMILY.hf_state_dict
read_hf_llama = FAMILY.read
