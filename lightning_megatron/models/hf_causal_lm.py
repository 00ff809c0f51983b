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
sequences), expert parallelism, the chunked loss, FP8, selective recomputation (``"full"`` works), a final logit
soft-cap and generation (``predict_step`` gives the logits of samples). Dropout inside transformers' layers draws
from the default stream at every layout.

``transformers`` is needed by this module only: ``pip install 'lightning-megatron[transformers]'``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor
from torchmetrics import MeanMetric

from lightning_megatron.generation import full_logits
from lightning_megatron.models.gpt import side_inputs
from lightning_megatron.models.hf_family import check_family, read_config, transformers_module
from lightning_megatron.models.hf_stages import CausalLMStages, build_causal_lm, lora_for
from lightning_megatron.models.hf_weights import ParametersOnMeta, SafetensorsWeights
from lightning_megatron.models.optim_recipe import PretrainingRecipe
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.peft.lora import LoRAConfig, apply_lora
from lightning_megatron.peft.merge import adapter_weight_names, layer_adapters, merged_weight
from lightning_megatron.pipeline.blocks import PipelineBlocks
from lightning_megatron.pipeline.layout import PipelineLayout


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
        with torch.device("cpu"), ParametersOnMeta():
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

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        loss_sum, num_tokens = self.model.loss(batch["input_ids"], batch["labels"], **side_inputs(batch))
        self.log("train_loss", self.global_token_mean(loss_sum, num_tokens), prog_bar=True)
        return {"loss": loss_sum / num_tokens.clamp(min=1), "num_tokens": num_tokens}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss_sum, num_tokens = self.model.loss(batch["input_ids"], batch["labels"], **side_inputs(batch))
        self.val_loss.update(loss_sum / num_tokens.clamp(min=1), weight=num_tokens)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int = 0) -> dict[str, Tensor]:
        """``{"logits": [B, S, vocab_size]}`` of a batch of samples, in fp32 over the whole, unpadded vocabulary, on
        every rank at every layout (as ``GPT``'s for samples; generation is the native route's)."""
        return {"logits": full_logits(self.model, batch["input_ids"], **side_inputs(batch))}

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
