"""A ``transformers`` causal LM's own modules as a model of this package: the pipeline protocol over them
(``pipeline/blocks.py``), its tensor-parallel plan, transformers' masks and rotary positions per attention type, and
its parameters' start (read from a directory, or transformers' initialisation drawn per name)."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Mapping, Optional

import torch
from torch import Tensor, nn

from lightning_megatron.models.hf_family import (BASE_MODULES, MASKS, causal_lm_plan, plan_of_present,
                                                 transformers_module)
from lightning_megatron.models.hf_weights import ParametersOnMeta, SafetensorsWeights
from lightning_megatron.parallel.initialize import default_initializer
from lightning_megatron.peft.lora import DEFAULT_TARGETS, LoRAConfig
from lightning_megatron.pipeline.blocks import PipelineBatch, PipelineBlocks

IGNORE_INDEX = -100
#: LoRA's default targets here: those of transformers' attention and MLP projections the model has (PEFT's names).
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                    "down_proj")


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
            ids = self.document_ids

            def same_document(batch, head, query, key):
                return ids[batch, query] == ids[batch, key]

            # No position_ids: from positions that restart transformers would infer packed documents (and window
            # by positions); here, as in GPT, only document_ids confine attention, and windows count tokens.
            mask = getattr(masking, MASKS[attention_type])(  # config, embeddings, padding mask, cache
                self.config, hidden, None, None, position_ids=None,
                and_mask_function=None if ids is None else same_document)
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
        self.plan = plan_of_present(self, causal_lm_plan(self.config))  # refused here, before any layout
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
    with torch.device("cpu"), ParametersOnMeta() as built:
        causal_lm = auto.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return CausalLMStages(causal_lm, built.fills, weights)
