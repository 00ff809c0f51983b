"""The model of a Hugging Face directory (or of a bare ``config.json``) for the planner, from ``config.json`` alone.

``lightning-megatron plan --model DIR`` plans the model a user already holds. A family this package converts
(``huggingface.convert.FAMILIES``: GPT-2, BERT, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE) is read by its
own config translation, as ``GPT(pretrained=DIR)`` reads it: the plan is that of the model ``fit`` would train.
Any other causal LM whose config has the standard decoder fields (``STANDARD_FIELDS``: Phi-3, OLMo 2, Gemma 3's
text model, ...) is planned as the Llama-shaped ``GPTConfig`` of the same sizes (RMSNorm, a gated MLP of
``intermediate_size``, rotary positions, grouped-query attention of ``head_dim``-wide heads), and the plan says
so: which fields it read and which it did not model (``HFModel.notes``). The bytes the planner counts are those
of the weights' matrices, their optimizer states and the activations they store, which fused projections
(Phi-3's ``qkv_proj``) or norms placed after a sub-layer (OLMo 2) do not change; gains of extra norms are a few
parameters per layer, stated by ``transformers_parameters`` where ``transformers`` is installed. A multimodal
model's config (sizes under ``text_config``: Gemma 3's 4B-27B) plans its text model. A config without those
fields, of an encoder, an encoder-decoder, a classifier or a Mixture-of-Experts family we do not convert, is
refused by name.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from lightning_megatron.huggingface.convert import FAMILIES
from lightning_megatron.huggingface.io import weight_names
from lightning_megatron.models.gpt import GPT, LLAMA, GPTConfig

#: The fields a decoder's ``config.json`` must have to be planned as its Llama-shaped equivalent.
STANDARD_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "vocab_size", "max_position_embeddings")
#: Fields the equivalent does not model, and why the plan's bytes hold anyway (shown when the config sets them).
NOT_MODELLED = {
    "sliding_window": "sliding-window attention planned as full attention: flash attention stores the same "
                      "tensors whatever the window, and the FLOPs counted are full attention's (an upper bound)",
    "layer_types": "per-layer attention types planned as full attention in every layer",
    "attn_logit_softcapping": "attention logits' soft-capping (a tanh inside the attention kernel)",
    "final_logit_softcapping": "the output logits' soft-capping (one tanh over the logits)",
    "query_pre_attn_scalar": "the attention's scale (no bytes)",
    "partial_rotary_factor": "rotary positions over part of each head (no bytes)",
    "attention_bias": "biases on the attention's projections (a few parameters per layer)",
    "mlp_bias": "biases on the MLP's projections (a few parameters per layer)",
}
#: Fields of a Mixture-of-Experts config: such a family we do not convert has no dense equivalent.
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face config's model for the planner: our config, the family, whether it converts natively
    (``GPT(pretrained=DIR)``, or BERT's, reads the directory), and what the plan read and did not model, in words."""

    path: Path
    model_type: str
    config: Any  # GPTConfig or BERTConfig
    native: bool
    notes: tuple[str, ...]
    fields: Mapping[str, Any]

    @property
    def lightning_module(self) -> type:
        return FAMILIES[self.model_type].lightning_module if self.native else GPT

    def make_module(self):
        """A new LightningModule of this config (the planner builds it on the meta device)."""
        return self.lightning_module(config=self.config)

    def parameters(self) -> int:
        """Parameters of our model of this config (no vocabulary padding), counted on the meta device."""
        with torch.device("meta"):
            module = self.make_module()
            module.configure_model()
        return sum(p.numel() for p in module.parameters())


def read_config_json(path: Union[str, os.PathLike]) -> tuple[Path, dict[str, Any]]:
    """``path``'s config.json fields: ``path`` is a ``save_pretrained`` directory or a ``.json`` file."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"--model {path}: no config.json there; pass a Hugging Face model directory "
                                f"(save_pretrained's) or its config.json.")
    try:
        return file, json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"--model {file}: not JSON ({error}).") from None


def hf_model(path: Union[str, os.PathLike]) -> HFModel:
    """The model ``path``'s config.json describes (no weights read; a directory's safetensors headers give the
    weight names a family may need, e.g. BERT's next-sentence head). A multimodal model's config (Gemma 3's 4B-27B:
    its sizes under ``text_config``) gives its text model, which is what trains on text."""
    file, fields = read_config_json(path)
    model_type = fields.get("model_type")
    text = fields.get("text_config")
    if model_type not in FAMILIES and isinstance(text, dict) and any(name not in fields for name in STANDARD_FIELDS):
        towers = sorted(name for name in fields if name.endswith("_config") and name != "text_config")
        model = _model_of(text, file, ())  # the checkpoint's weight names are not its text model's
        said = (f"{model_type}: a multimodal model; its text model (text_config) planned, not its other towers "
                f"({', '.join(towers) or 'none'}); GPT(pretrained=...) does not read this directory")
        return replace(model, native=False, notes=(said, *model.notes))
    directory = file.parent if file.name == "config.json" else None
    return _model_of(fields, file, weight_names(directory) if directory else ())


def _model_of(fields: Mapping[str, Any], file: Path, names: Sequence[str]) -> HFModel:
    """A family we convert, by its own translation; else (or where it refuses this config) the Llama-shaped
    equivalent."""
    model_type = fields.get("model_type")
    native_error = None
    if model_type in FAMILIES:
        family = FAMILIES[model_type]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                config = family.config_from_hf(fields, names)
            except ValueError as error:
                native_error = str(error)
            else:
                notes = [f"{model_type}: converted as GPT(pretrained=...) reads it ({family.expected.split()[-1]}); "
                         f"no weights read"] + [str(w.message) for w in caught]
                return HFModel(file, model_type, config, True, tuple(notes), fields)
    config, notes = llama_shaped_equivalent(fields, file)
    if native_error is not None:
        notes.insert(0, f"{model_type} is a family we convert, but not this config ({native_error}); planned as "
                        f"its Llama-shaped equivalent instead")
    return HFModel(file, str(model_type), config, False, tuple(notes), fields)


def llama_shaped_equivalent(fields: Mapping[str, Any], file: Path) -> tuple[GPTConfig, list[str]]:
    """The Llama-shaped ``GPTConfig`` of a decoder config's sizes, and the notes saying what was read and what
    not modelled; ``ValueError`` naming what is missing or what has no dense decoder equivalent."""
    model_type = fields.get("model_type")
    problems = []
    missing = [name for name in STANDARD_FIELDS if fields.get(name) is None]
    if missing:
        problems.append(f"it lacks {', '.join(missing)}")
    architectures = fields.get("architectures") or []
    if architectures and not any(str(a).endswith("ForCausalLM") for a in architectures):
        problems.append(f"architectures={architectures}: not a causal language model (...ForCausalLM)")
    for flag in ("is_encoder_decoder", "use_bidirectional_attention"):
        if fields.get(flag):
            problems.append(f"{flag}=True: not a causal decoder")
    experts = {name: fields[name] for name in EXPERT_FIELDS if fields.get(name)}
    if experts:
        problems.append(f"{', '.join(f'{k}={v}' for k, v in experts.items())}: a Mixture-of-Experts model; the "
                        f"equivalent is dense (MoE families we convert: mixtral, qwen2_moe, qwen3_moe, gpt_oss)")
    if problems:
        raise ValueError(f"{file}: model_type={model_type!r} cannot be planned: {'; '.join(problems)}. The planner "
                         f"reads the families we convert ({', '.join(sorted(FAMILIES))}) and causal LMs with the "
                         f"standard decoder fields ({', '.join(STANDARD_FIELDS)}; head_dim and tie_word_embeddings "
                         f"optional).")
    hidden, heads, groups = fields["hidden_size"], fields["num_attention_heads"], fields["num_key_value_heads"]
    head_dim = fields.get("head_dim") or hidden // heads
    tied = fields.get("tie_word_embeddings")
    config = GPTConfig(vocab_size=fields["vocab_size"], max_seq_length=fields["max_position_embeddings"],
                       hidden_size=hidden, num_layers=fields["num_hidden_layers"], num_heads=heads,
                       num_query_groups=None if groups == heads else groups, ffn_hidden_size=fields["intermediate_size"],
                       kv_channels=head_dim, tie_embeddings=bool(tied), dropout=0.0, **LLAMA)
    read = ", ".join(f"{name}={fields[name]}" for name in (*STANDARD_FIELDS, "head_dim", "tie_word_embeddings")
                     if name in fields)
    notes = [f"{model_type}: planned as the Llama-shaped GPTConfig of its sizes (RMSNorm, gated MLP, rotary "
             f"positions, grouped-query attention) from {read}",
             "fused or split projections (qkv_proj, gate_up_proj), norms placed before or after a sub-layer and the "
             "MLP's activation change no bytes the planner counts; q/k norms' and extra norms' gains are not modelled"]
    if tied is None:
        notes.append("tie_word_embeddings absent: planned untied (the larger)")
    activation = fields.get("hidden_activation") or fields.get("hidden_act")
    if activation not in (None, "silu"):
        notes.append(f"activation {activation!r}: planned as SwiGLU's gated MLP (the same GEMMs and stored tensors)")
    for name, why in NOT_MODELLED.items():
        value = fields.get(name)
        unset = value is None or value is False or (not isinstance(value, bool) and value in (0, 1))  # 1: all of it
        if not unset and not (name == "layer_types" and set(value) <= {"full_attention"}):
            shown = f"{len(value)} entries" if isinstance(value, list) else repr(value)
            notes.append(f"not modelled: {name}={shown}: {why}")
    return config, notes


def transformers_parameters(fields: Mapping[str, Any]) -> Optional[tuple[str, int]]:
    """(class name, parameters) of ``transformers``' causal LM built from these fields on the meta device; None
    where ``transformers`` is not installed or has no causal LM of this config."""
    try:
        import transformers
    except ImportError:
        return None
    try:
        config = transformers.AutoConfig.for_model(**{k: v for k, v in fields.items() if k != "architectures"})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return type(model).__name__, sum(p.numel() for p in model.parameters())
