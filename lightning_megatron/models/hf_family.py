"""What ``HFCausalLM`` reads of a ``transformers`` family: its config, and the tensor-parallel plan its config class
carries, in this package's styles (:data:`TP_STYLES`), refusing by name what it cannot split."""

from __future__ import annotations

import os
from typing import Any, Mapping, Union

from torch import nn

from lightning_megatron.parallel.names import name_matches
from lightning_megatron.tensor_parallel.plan import REGION_STYLES
from lightning_megatron.tensor_parallel.styles import PackedColumn

TRANSFORMERS_HINT = "pip install 'lightning-megatron[transformers]'"

#: transformers' tensor-parallel styles (``base_model_tp_plan``) -> this package's plan styles
#: (``tensor_parallel.plan``). ``replicate`` keeps the module whole: no entry.
TP_STYLES: dict[str, object] = {
    "colwise": "column",
    "rowwise": "row",
    "colwise_gather_output": "column_gather_output",
    "colwise_rep": "column_gather_output",
    "rowwise_split_input": "row_split_input",
    "rowwise_rep": "row_split_input",
    "packed_colwise": PackedColumn(2),
    "embedding_rowwise": "vocab",
    "replicated_with_grad_allreduce": "replicated_with_grad_allreduce",
    "sequence_parallel": "sequence_parallel",
    "replicate": None,
}
#: The attention types (``config.layer_types``) whose masks transformers makes with these functions.
MASKS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}
BASE_MODULES = ("embed_tokens", "layers", "norm")
def transformers_module():
    """``transformers``, or an ``ImportError`` naming the extra that installs it."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError(f"HFCausalLM builds transformers' own modules: {TRANSFORMERS_HINT}") from error
    return transformers


def read_config(config: Union[str, os.PathLike, Mapping[str, Any], Any]):
    """A ``transformers`` config from a directory (its ``config.json``), a dict of its fields (with
    ``model_type``) or a config object."""
    auto = transformers_module().AutoConfig
    if isinstance(config, (str, os.PathLike)):
        return auto.from_pretrained(os.fspath(config))
    if isinstance(config, Mapping):
        fields = dict(config)
        if "model_type" not in fields:
            raise ValueError("A config given as a dict needs its 'model_type' (e.g. 'qwen3'), as config.json has it.")
        return auto.for_model(fields.pop("model_type"), **fields)
    return config


def tensor_parallel_styles(config) -> dict[str, object]:
    """``config.base_model_tp_plan`` in this package's styles (names relative to the base model); a ``ValueError``
    naming the family and what is missing when there is no plan or a style has no mapping."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(
            f"model_type={config.model_type!r}: transformers' {type(config).__name__} carries no base_model_tp_plan, "
            f"which HFCausalLM splits the model by. It needs a plan naming the linear layers' styles (e.g. "
            f"{{'layers.*.self_attn.q_proj': 'colwise', 'layers.*.self_attn.o_proj': 'rowwise', ...}}) in the config "
            f"class; or run the family natively where GPT.from_hf converts it.")
    unknown = {pattern: style for pattern, style in plan.items() if style not in TP_STYLES}
    if unknown:
        raise ValueError(
            f"model_type={config.model_type!r}: transformers' tensor-parallel plan uses styles HFCausalLM has no "
            f"mapping for: {unknown}. Mapped styles: {sorted(TP_STYLES)}; these would need a parallel layer of "
            f"tensor_parallel.plan that computes the same split.")
    return {pattern: TP_STYLES[style] for pattern, style in plan.items() if TP_STYLES[style] is not None}


def check_family(config) -> None:
    """What HFCausalLM needs of a family, else a ``ValueError`` naming it: both plans, the pipeline plan's
    ``embed_tokens`` / ``layers`` / ``norm``, attention types it makes masks for, no final logit soft-cap."""
    tensor_parallel_styles(config)
    pp_plan = getattr(config, "base_model_pp_plan", None) or {}
    if set(pp_plan) != set(BASE_MODULES):
        raise ValueError(
            f"model_type={config.model_type!r}: HFCausalLM runs decoders whose base_model_pp_plan names "
            f"{list(BASE_MODULES)} (token embedding, decoder layers, final norm), but {type(config).__name__}'s is "
            f"{pp_plan or 'missing'}.")
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(MASKS))
    if unknown:
        raise ValueError(f"model_type={config.model_type!r} has layers of attention types {unknown}; HFCausalLM "
                         f"makes masks for {sorted(MASKS)} only.")
    if getattr(config, "final_logit_softcapping", None):
        raise ValueError(f"model_type={config.model_type!r} soft-caps its logits (final_logit_softcapping="
                         f"{config.final_logit_softcapping}), which the vocabulary-parallel loss does not apply.")


def causal_lm_plan(config) -> dict[str, object]:
    """The tensor-parallel plan of a :class:`CausalLMStages`: transformers' for the layers, ours (vocabulary-parallel)
    for the token embedding, the head and the loss."""
    layers = {f"model.{pattern}": style for pattern, style in tensor_parallel_styles(config).items()}
    return {"model.embed_tokens": "vocab", **layers, "lm_head": "vocab", "loss_fn": "vocab"}


def plan_of_present(model: nn.Module, plan: Mapping[str, object]) -> dict[str, object]:
    """The entries of ``plan`` that name submodules of ``model`` (transformers' plans name the layers of every variant
    of a family: Qwen3-MoE's dense MLPs where a config has none); a ``ValueError`` naming an entry that names a
    split module other than an ``nn.Linear`` (``nn.Embedding`` for ``"vocab"``) or parameters (a Mixture of Experts'
    fused expert tensors): not layers this package splits."""
    modules, kept = dict(model.named_modules()), {}
    for pattern, style in plan.items():
        found = [name for name in modules if name and name_matches(pattern, name)]
        parameters = [name for name, _ in model.named_parameters() if name_matches(pattern, name)]
        wrong = {name: type(modules[name]).__name__ for name in found if style not in REGION_STYLES
                 and not isinstance(modules[name], (nn.Linear, nn.Embedding, nn.CrossEntropyLoss))}
        if wrong or parameters:
            raise ValueError(
                f"model_type={model.config.model_type!r}: the plan entry {pattern!r} ({style!r}) names "
                f"{wrong or parameters}, not linear layers, which is what HFCausalLM splits (a Mixture of Experts' "
                f"fused expert tensors need expert parallelism: the native GPT has it where the family converts).")
        if found:
            kept[pattern] = style
    return kept
