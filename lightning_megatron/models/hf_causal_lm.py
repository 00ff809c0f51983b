"""HFCausalLM: a ``transformers`` causal LM trained through its own modules, split by the plans its config carries.

The native route (``GPT.from_hf``) converts a checkpoint into this package's layers, where every speed feature
applies. This route takes any family whose ``transformers`` config class declares how to split it, unconverted:
``configure_model`` builds the directory's ``AutoModelForCausalLM`` with its parameters on the meta device, and the
strategy splits it like any model here, by the plans the model declares:

* ``tensor_parallel_plan()``: ``config.base_model_tp_plan`` (names under ``model.``), each transformers style mapped
  onto one of ours (:data:`TP_STYLES`); the token embedding, the head and the loss are split over the vocabulary
  (``"vocab"``: the logits are never gathered, the cross-entropy is vocab-parallel), whatever the family's own
  ``lm_head`` style says. A style with no mapping is refused by name when the module is built.
* ``pipeline_blocks()``: ``config.base_model_pp_plan`` names ``embed_tokens``, ``layers`` and ``norm``; the layers
  become an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... (the same parameter names), so a stage keeps global
  names. Masks and rotary positions are made per attention type (``config.layer_types``: full or sliding window)
  by transformers' own functions, once per forward and stage, and handed to each layer by a forward pre-hook.

Parameter names are transformers' (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``), so a
``save_pretrained`` directory loads tensor by tensor, where the strategy materialises each parameter: a rank reads
only its part (its tensor-parallel rows or columns) of the tensors of its own pipeline stage, by slices of the
memory-mapped file (:class:`SafetensorsWeights`), and never holds the whole model or a whole split tensor. A model
built from a config alone starts as transformers initialises it (weights ``N(0, initializer_range)``, biases zero,
norm gains as their constructors set them), drawn per parameter name, so every layout starts alike.

What this route gives up against the native one, said when refused: sequence and context parallelism
(transformers' plans for these families have no ``sequence_parallel`` entries, and its attention takes whole
sequences), expert parallelism, the chunked loss, FP8, selective recomputation (``"full"`` works) and a final
logit soft-cap. Dropout inside transformers' layers draws from the default stream at every layout.

``transformers`` is needed by this module only: ``pip install 'lightning-megatron[transformers]'``.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_megatron.models.optim_recipe import PretrainingRecipe
from lightning_megatron.parallel.initialize import default_initializer, initialize_parameters
from lightning_megatron.parallel.names import name_matches
from lightning_megatron.parallel.shards import TensorShard
from lightning_megatron.peft.lora import DEFAULT_TARGETS, LoRAConfig, apply_lora
from lightning_megatron.peft.merge import adapter_weight_names, layer_adapters, merged_weight
from lightning_megatron.pipeline.blocks import PipelineBlocks, PipelineBatch
from lightning_megatron.pipeline.layout import PipelineLayout
from lightning_megatron.tensor_parallel.plan import REGION_STYLES
from lightning_megatron.tensor_parallel.styles import PackedColumn

IGNORE_INDEX = -100
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
#: LoRA's default targets here: those of transformers' attention and MLP projections the model has (PEFT's names).
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                    "down_proj")


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


class SafetensorsWeights:
    """The tensors of a ``save_pretrained`` directory (``model.safetensors`` or sharded with an index), read one at
    a time by name, a rank's part of each only (``read_local``): the initialiser of a model's parameters."""

    def __init__(self, directory: Union[str, os.PathLike]) -> None:
        self.directory = Path(directory)
        single, index = self.directory / "model.safetensors", self.directory / "model.safetensors.index.json"
        if single.is_file():
            from safetensors import safe_open
            with safe_open(str(single), framework="pt") as weights:
                self.files = dict.fromkeys(weights.keys(), single.name)
        elif index.is_file():
            self.files = json.loads(index.read_text())["weight_map"]
        else:
            raise FileNotFoundError(f"{self.directory} holds no safetensors weights (model.safetensors or "
                                    f"model.safetensors.index.json, as save_pretrained writes them).")

    def read_local(self, name: str, shard: Optional[TensorShard], global_shape: tuple[int, ...]) -> Tensor:
        """This rank's part of tensor ``name`` (``shard``: its tensor-parallel split; None: the whole), in fp32 with
        zero padding, as ``parallel.initialize.local_initial_values`` returns it; reads only the part's rows (or
        columns) of the file."""
        with self._open(name) as weights:
            part = weights.get_slice(name)
            if tuple(part.get_shape()) != tuple(global_shape):
                raise ValueError(f"{self.directory}: {name} has shape {tuple(part.get_shape())}, the model built "
                                 f"from its config {tuple(global_shape)}.")
            if shard is None:
                return part[:].to(torch.float32)
            local = torch.zeros(shard.local_shape, dtype=torch.float32)
            for segment in shard.segments():
                rows = [slice(None)] * len(global_shape)
                rows[shard.dim] = slice(segment.start, segment.start + segment.size)
                local.narrow(shard.dim, segment.local_start, segment.size).copy_(part[tuple(rows)])
            return local

    def __call__(self, name: str, tensor: Tensor, generator: torch.Generator) -> None:
        """As an initialiser (``initialize_parameter``) of the whole tensor: ``read_local`` serves every caller."""
        tensor.copy_(self.read_local(name, None, tuple(tensor.shape)))

    def _open(self, name: str):
        if name not in self.files:
            raise KeyError(f"{self.directory} has no tensor {name!r} (it has e.g. {sorted(self.files)[:4]}).")
        from safetensors import safe_open
        return safe_open(str(self.directory / self.files[name]), framework="pt")


def causal_lm_plan(config) -> dict[str, object]:
    """The tensor-parallel plan of a :class:`CausalLMStages`: transformers' for the layers, ours (vocabulary-parallel)
    for the token embedding, the head and the loss."""
    layers = {f"model.{pattern}": style for pattern, style in tensor_parallel_styles(config).items()}
    return {"model.embed_tokens": "vocab", **layers, "lm_head": "vocab", "loss_fn": "vocab"}


class _ParametersOnMeta:
    """Inside: modules register their parameters on the meta device (buffers stay where they are made: the rotary
    frequencies are computed, not loaded). Records each 1-D parameter's constructor value where it is one constant
    (a norm's gain: ones, or zeros for Gemma's ``1 + w``), the start transformers gives it."""

    def __enter__(self):
        self.fills: dict[int, float] = {}
        self.original = nn.Module.register_parameter
        fills, original = self.fills, self.original

        def register(module, name, param):
            if param is not None and not param.is_meta:
                value = param.detach()
                meta = nn.Parameter(value.to("meta"), requires_grad=param.requires_grad)
                if value.dim() == 1 and value.numel() and bool((value == value[0]).all()):
                    fills[id(meta)] = float(value[0])
                param = meta
            original(module, name, param)

        nn.Module.register_parameter = register
        return self

    def __exit__(self, *exc_info) -> None:
        nn.Module.register_parameter = self.original


class _TokenEmbeddingOutput:
    """A forward hook that gives a plain ``nn.Embedding`` (which the plan can split by vocabulary) what transformers'
    embedding did besides the lookup: ``padding_idx``'s row gets no gradient from the positions holding it, and a
    scaled embedding (Gemma's) multiplies by its scale in the weights' dtype."""

    def __init__(self, padding_idx: Optional[int], scale: Optional[float]) -> None:
        self.padding_idx, self.scale = padding_idx, scale

    def __call__(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        if self.padding_idx is not None:
            output = torch.where((args[0] == self.padding_idx).unsqueeze(-1), output.detach(), output)
        if self.scale is not None:
            output = output * torch.tensor(self.scale, dtype=output.dtype, device=output.device)
        return output


def _plain_embedding(embedding: nn.Embedding) -> nn.Embedding:
    if not isinstance(embedding, nn.Embedding):
        raise ValueError(f"HFCausalLM expects embed_tokens to be an nn.Embedding, got {type(embedding).__name__}.")
    scale = getattr(embedding, "scalar_embed_scale", None)
    if type(embedding) is not nn.Embedding and scale is None:
        raise ValueError(f"embed_tokens is a {type(embedding).__name__}, whose forward HFCausalLM does not know (it "
                         f"knows nn.Embedding and transformers' scaled embeddings, which have scalar_embed_scale).")
    if embedding.max_norm is not None or embedding.sparse:
        raise ValueError("HFCausalLM supports token embeddings without max_norm and sparse gradients.")
    plain = nn.Embedding(embedding.num_embeddings, embedding.embedding_dim, device="meta")
    plain.weight = embedding.weight
    plain.register_forward_hook(_TokenEmbeddingOutput(embedding.padding_idx, scale))
    return plain


class _LayerInputs:
    """What every decoder layer of one forward takes besides the hidden states, made once per attention type from
    the first hidden states a stage sees (their shape and dtype): transformers' mask (causal, or with its sliding
    window; confined to each document with ``document_ids``) and its rotary ``(cos, sin)``."""

    def __init__(self, config, rotary: nn.Module, position_ids: Optional[Tensor],
                 document_ids: Optional[Tensor]) -> None:
        self.config, self.rotary = config, rotary
        self.position_ids, self.document_ids = position_ids, document_ids
        self.made: dict[str, dict] = {}

    def for_layer(self, attention_type: str, hidden: Tensor) -> dict:
        if attention_type not in self.made:
            masking = transformers_module().masking_utils
            positions = self.position_ids
            if positions is None:
                positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            documents = None
            if self.document_ids is not None:
                ids = self.document_ids

                def documents(batch, head, query, key):
                    return ids[batch, query] == ids[batch, key]

            # No position_ids: from positions that restart transformers would infer packed documents (and window
            # by positions); here, as in GPT, only document_ids confine attention, and windows count tokens.
            mask = getattr(masking, MASKS[attention_type])(  # config, embeddings, padding mask, cache
                self.config, hidden, None, None, position_ids=None, and_mask_function=documents)
            by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
            rope = self.rotary(hidden, positions, attention_type) if by_type else self.rotary(hidden, positions)
            self.made[attention_type] = {"attention_mask": mask, "position_embeddings": rope,
                                         "position_ids": positions}
        return self.made[attention_type]


def _take_layer_inputs(attention_type: str):
    def hook(_module: nn.Module, args: tuple, kwargs: dict):
        inputs = kwargs.pop("layer_inputs", None)
        if inputs is None:
            return None
        return args, {**kwargs, **inputs.for_layer(attention_type, args[0])}

    return hook


class CausalLMStages(nn.Module):
    """A ``transformers`` ``*ForCausalLM``'s modules under their own names (``model.embed_tokens``,
    ``model.layers.<i>``, ``model.norm``, ``lm_head``) and the pipeline protocol over them (``pipeline/blocks.py``),
    which ``forward`` and ``loss`` are built from. ``weights``: a :class:`SafetensorsWeights` the parameters start
    from (else transformers' initialisation, drawn per name)."""

    def __init__(self, causal_lm: nn.Module, fills: Mapping[int, float], weights: Optional[SafetensorsWeights]):
        super().__init__()
        self.config = causal_lm.config
        base = causal_lm.model
        missing = [name for name in BASE_MODULES if getattr(base, name, None) is None]
        if missing or not hasattr(causal_lm, "lm_head"):
            raise ValueError(f"{type(causal_lm).__name__} has no {missing or ['lm_head']}; HFCausalLM needs a base "
                             f"model with {list(BASE_MODULES)} and an lm_head.")
        tied = causal_lm.lm_head.weight is base.embed_tokens.weight
        base.embed_tokens = _plain_embedding(base.embed_tokens)
        base.layers = nn.ModuleDict({str(index): layer for index, layer in enumerate(base.layers)})
        types = getattr(self.config, "layer_types", None) or ["full_attention"] * len(base.layers)
        for index, layer in base.layers.items():
            layer.register_forward_pre_hook(_take_layer_inputs(types[int(index)]), with_kwargs=True)
        self.model, self.lm_head = base, causal_lm.lm_head
        if tied:
            self.lm_head.weight = base.embed_tokens.weight
        self.loss_fn = nn.CrossEntropyLoss(reduction="sum", ignore_index=IGNORE_INDEX)
        self.plan = _plan_of_present(self, causal_lm_plan(self.config))  # refused here, before any layout
        if weights is not None:
            self.initialize_parameter = weights  # read, not drawn: SafetensorsWeights.read_local
        names = {id(param): name for name, param in self.named_parameters()}
        self.fills = {names[key]: value for key, value in fills.items() if key in names}

    def initialize_parameter(self, name: str, tensor: Tensor, generator: torch.Generator) -> None:
        """Transformers' start of parameter ``name`` (its name): matrices ``N(0, initializer_range)``, biases zero,
        other vectors their constructor's constant. With ``weights``, the instance's ``initialize_parameter`` is
        that reader instead (``__init__``), which reads each rank's part of the file."""
        if tensor.dim() >= 2:
            tensor.normal_(0.0, self.config.initializer_range, generator=generator)
        elif name in self.fills and not name.endswith("bias"):
            tensor.fill_(self.fills[name])
        else:
            default_initializer(name, tensor, generator)

    @staticmethod
    def pipeline_blocks() -> PipelineBlocks:
        return PipelineBlocks(first=("model.embed_tokens",), layers="model.layers",
                              last=("model.norm", "lm_head", "loss_fn"))

    def tensor_parallel_plan(self) -> dict[str, object]:
        return dict(self.plan)

    # The pipeline protocol (pipeline/blocks.py): side inputs are the optional position_ids and document_ids.
    def embed(self, input_ids: Tensor, **side: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def layer_kwargs(self, *, position_ids: Optional[Tensor] = None, document_ids: Optional[Tensor] = None,
                     **side) -> dict:
        return {"layer_inputs": _LayerInputs(self.config, self.model.rotary_emb, position_ids, document_ids)}

    def head(self, x: Tensor, **side) -> Tensor:
        return self.lm_head(self.model.norm(x))

    def pipeline_batch(self, input_ids: Tensor, labels: Tensor, *, position_ids: Optional[Tensor] = None,
                       document_ids: Optional[Tensor] = None) -> PipelineBatch:
        side = {name: value for name, value in (("position_ids", position_ids), ("document_ids", document_ids))
                if value is not None}
        return PipelineBatch(inputs=(input_ids,), target=labels, num_tokens=(labels != IGNORE_INDEX).sum(), side=side)

    def pipeline_loss(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, dict]:
        return self.loss_fn(logits.flatten(0, 1), labels.flatten()), {}

    @staticmethod
    def pipeline_result(loss_sum: Tensor, num_tokens: Tensor, extras: dict) -> tuple[Tensor, Tensor]:
        return loss_sum, num_tokens

    def forward(self, input_ids: Tensor, *, position_ids: Optional[Tensor] = None,
                document_ids: Optional[Tensor] = None) -> Tensor:
        """Logits ``[B, S, V]`` (``V / tp`` under tensor parallelism)."""
        side = {name: value for name, value in (("position_ids", position_ids), ("document_ids", document_ids))
                if value is not None}
        x = self.embed(input_ids, **side)
        kwargs = self.layer_kwargs(**side)
        for layer in self.model.layers.values():
            x = layer(x, **kwargs)
        return self.head(x, **side)

    def loss(self, input_ids: Tensor, labels: Tensor, **side: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """``(sum of token losses, number of counted tokens)``; labels of ``-100`` are ignored."""
        batch = self.pipeline_batch(input_ids, labels, **side)
        loss_sum, extras = self.pipeline_loss(self(input_ids, **batch.side), labels)
        return self.pipeline_result(loss_sum, batch.num_tokens, extras)


def _plan_of_present(model: nn.Module, plan: Mapping[str, object]) -> dict[str, object]:
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


def lora_for(model: nn.Module, lora: LoRAConfig) -> LoRAConfig:
    """``lora`` with, in place of the GPT's default targets, every attention and MLP projection ``model`` has
    (:data:`LORA_PROJECTIONS`: ``q_proj`` ... ``down_proj``, Phi-3's fused ``qkv_proj`` and ``gate_up_proj``)."""
    if tuple(lora.targets) != DEFAULT_TARGETS:
        return lora
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    return replace(lora, targets=[f"*.{name}" for name in LORA_PROJECTIONS if name in names])


def build_causal_lm(config, *, weights: Optional[SafetensorsWeights] = None,
                    attn_implementation: str = "sdpa") -> CausalLMStages:
    """``config``'s ``AutoModelForCausalLM`` with its parameters on the meta device, as :class:`CausalLMStages`."""
    auto = transformers_module().AutoModelForCausalLM
    with torch.device("cpu"), _ParametersOnMeta() as built:
        causal_lm = auto.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return CausalLMStages(causal_lm, built.fills, weights)


#: The keys of a batch, besides ``input_ids`` and ``labels``, that the model takes (as ``GPT``'s).
SIDE_INPUTS = ("position_ids", "document_ids")


class HFCausalLM(PretrainingRecipe):
    """Any ``transformers`` causal LM whose config class carries tensor- and pipeline-parallel plans (Qwen3, Llama,
    Mistral, Phi-3, OLMo 2, Gemma 3, ...), trained through transformers' own modules with ``GPT``'s recipe and
    batches (``input_ids``, ``labels`` with -100, optional ``position_ids``/``document_ids``).

    Example::

        model = HFCausalLM(pretrained="path/to/Qwen3-0.6B", learning_rate=2e-5)
        trainer = L.Trainer(strategy=Megatron3DStrategy(tensor_parallel_size=2, pipeline_parallel_size=2), devices=8)

    ``pretrained``: a ``save_pretrained`` directory (safetensors): the model and its weights; each rank reads only
    its part of the tensors of its pipeline stage. The path is saved in the hyper-parameters, so
    ``load_from_checkpoint`` and a resumed run rebuild the same module. ``config``: the model without weights (a
    directory's ``config.json``, a dict of its fields with ``model_type``, or a ``transformers`` config), initialised
    as transformers does. ``attn_implementation``: transformers' attention kernel (``"sdpa"``, ``"eager"``, ...).
    ``lora``: a :class:`~lightning_megatron.peft.lora.LoRAConfig` (or its fields): adapters on
    transformers' own projection layers (by default every attention and MLP projection, PEFT's ``q_proj`` ...
    ``down_proj``), trained alone; ``to_hf`` merges them into the weights. ``training_step`` returns ``{"loss",
    "num_tokens"}`` as ``GPT``'s does.

    A family whose config has no plan, or whose plan uses a style with no mapping (:data:`TP_STYLES`), is refused
    by name (``ValueError``) when the module is built; so are layouts this route cannot split (module docstring).
    """

    def __init__(
        self,
        config: Union[str, os.PathLike, Mapping[str, Any], Any, None] = None,
        *,
        pretrained: Optional[Union[str, os.PathLike]] = None,
        attn_implementation: str = "sdpa",
        lora: Optional[Union[LoRAConfig, dict]] = None,
        learning_rate: float = 1e-3,
        min_learning_rate: float = 1e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        warmup_steps: int = 20,
        adam_implementation: str = "auto",
    ) -> None:
        super().__init__()
        pretrained = None if pretrained is None else os.fspath(pretrained)
        if config is None and pretrained is None:
            raise ValueError("HFCausalLM needs pretrained=<a save_pretrained directory> or config=<its config>.")
        config = read_config(pretrained if config is None else config)
        check_family(config)
        self.init_recipe(type(config), config, config_fields=lambda c: c.to_dict(), learning_rate=learning_rate,
                         min_learning_rate=min_learning_rate, weight_decay=weight_decay, betas=betas,
                         adam_eps=adam_eps, warmup_steps=warmup_steps, adam_implementation=adam_implementation)
        self.pretrained, self.attn_implementation = pretrained, attn_implementation
        self.lora = LoRAConfig.of(lora)
        self.save_hyperparameters({"pretrained": pretrained, "attn_implementation": attn_implementation,
                                   "lora": None if self.lora is None else self.lora.as_dict()})
        self.model: Optional[CausalLMStages] = None
        self.val_loss = MeanMetric()

    def configure_model(self) -> None:
        """Build the model with its parameters on the meta device; in one process (not under the strategy, whose
        preparation does it for this rank's shards) give them their start at once."""
        if self.model is not None:
            return
        on_meta = torch.empty(()).is_meta  # inside the strategy's model_sharded_context
        weights = None if self.pretrained is None else SafetensorsWeights(self.pretrained)
        model = build_causal_lm(self.config, weights=weights, attn_implementation=self.attn_implementation)
        if self.lora is not None:
            self.lora = lora_for(model, self.lora)
            apply_lora(model, self.lora)  # on the meta device: the adapters start by their own rule, per name
        if not on_meta:
            initialize_parameters(model, seed=torch.initial_seed(), device="cpu", only_meta=True)
        self.model = model

    @classmethod
    def from_hf(cls, model_or_dir: Union[str, os.PathLike], **kwargs: Any) -> "HFCausalLM":
        """``HFCausalLM(pretrained=model_or_dir, **kwargs)``, built at once (one process)."""
        module = cls(pretrained=model_or_dir, **kwargs)
        module.configure_model()
        return module

    def to_hf(self, out_dir: Union[str, os.PathLike], *, state_dict: Optional[Mapping[str, Tensor]] = None,
              max_shard_size: Union[int, str] = "5GB") -> None:
        """Write a ``save_pretrained`` directory of this model (transformers' own writer): the weights of
        ``state_dict`` (this module's names; default: its own; LoRA adapters merged into the weights they adapt) in
        ``config``'s ``AutoModelForCausalLM``. Under tensor or
        pipeline parallelism this module holds shards: gather on every rank, write on one::

            state_dict = trainer.strategy.full_state_dict(rank_zero_only=True)
            if trainer.is_global_zero:
                model.to_hf("exported", state_dict=state_dict)
        """
        state_dict = self.state_dict() if state_dict is None else state_dict
        weights = {name.removeprefix("model."): value for name, value in state_dict.items()
                   if name.startswith("model.")}
        for layer in layer_adapters(weights):  # LoRA: W + scale * B A, as PEFT's merge_and_unload
            lora_a, lora_b = adapter_weight_names(layer)
            weights[f"{layer}.weight"] = merged_weight(weights[f"{layer}.weight"], weights.pop(lora_a),
                                                       weights.pop(lora_b), self.lora.scale)
        auto = transformers_module().AutoModelForCausalLM
        with torch.device("cpu"), _ParametersOnMeta():
            causal_lm = auto.from_config(self.config, dtype=torch.float32)
        missing, unexpected = causal_lm.load_state_dict(weights, strict=False, assign=True)
        tied = {key for key in missing if getattr(causal_lm.config, "tie_word_embeddings", False)
                and key == "lm_head.weight"}
        if set(missing) - tied or unexpected:
            raise ValueError(f"The weights do not fit {type(causal_lm).__name__}: missing "
                             f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}.")
        causal_lm.tie_weights()
        causal_lm.save_pretrained(os.fspath(out_dir), max_shard_size=max_shard_size)

    def tensor_parallel_plan(self) -> dict[str, object]:
        return {f"model.{pattern}": style for pattern, style in self.model.tensor_parallel_plan().items()}

    @staticmethod
    def recompute_plan() -> dict[str, str]:
        return {}  # "full" recomputes each decoder layer; transformers' attention has no core to pick out

    def pipeline_blocks(self) -> PipelineBlocks:
        return CausalLMStages.pipeline_blocks().under("model")

    def validate_parallel_config(self, parallel_config) -> None:
        """Refuse, on every rank before any collective, what this route cannot split."""
        config, tp = self.config, parallel_config.tensor_parallel_size
        refused = {"sequence_parallel": parallel_config.sequence_parallel,
                   "context_parallel_size": parallel_config.context_parallel_size > 1,
                   "expert_parallel_size": parallel_config.expert_parallel_size > 1}
        for name, asked in refused.items():
            if asked:
                raise ValueError(
                    f"HFCausalLM ({config.model_type}) runs transformers' own layers, which split by "
                    f"base_model_tp_plan only (no sequence_parallel entries, whole sequences in attention, no "
                    f"expert plan): {name} is not available on this route. Use the native GPT (GPT.from_hf) where "
                    f"the family converts, or leave {name} at its default.")
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": kv_heads,
                 "intermediate_size": getattr(config, "intermediate_size", tp)}
        uneven = {name: size for name, size in sizes.items() if size % tp}
        if uneven:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {uneven} of {config.model_type!r}: "
                             f"transformers' plan splits them over tp. Use a tensor_parallel_size that divides them.")
        PipelineLayout(num_layers=config.num_hidden_layers,
                       pipeline_parallel_size=parallel_config.pipeline_parallel_size,
                       virtual_pipeline_size=parallel_config.virtual_pipeline_size,
                       layers_per_stage=parallel_config.pipeline_layers_per_stage)

    def forward(self, input_ids: Tensor, **side: Tensor) -> Tensor:
        return self.model(input_ids, **side)

    @staticmethod
    def _side(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {name: batch[name] for name in SIDE_INPUTS if name in batch}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        loss_sum, num_tokens = self.model.loss(batch["input_ids"], batch["labels"], **self._side(batch))
        self.log("train_loss", loss_sum.detach() / num_tokens.clamp(min=1), prog_bar=True, sync_dist=True)
        return {"loss": loss_sum / num_tokens.clamp(min=1), "num_tokens": num_tokens}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss_sum, num_tokens = self.model.loss(batch["input_ids"], batch["labels"], **self._side(batch))
        self.val_loss.update(loss_sum / num_tokens.clamp(min=1), weight=num_tokens)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
