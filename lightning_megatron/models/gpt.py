"""GPT: a pre-norm decoder in the style of GPT-2 and Megatron-LM, as a LightningModule.

``GPTModel`` is plain PyTorch (readable like nanoGPT); ``GPT`` adds the training recipe
(per-token loss, AdamW, warmup + cosine) and declares what tensor parallelism may split.
Under ``Megatron3DStrategy`` the model is built on the meta device in ``configure_model``
and only this rank's shards are ever materialised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_megatron.models.optim_recipe import PretrainingRecipe
from lightning_megatron.models.transformer import TransformerLayer, TransformerSizes, layer_tensor_parallel_plan
from lightning_megatron.parallel.initialize import INIT_STD, default_initializer, initialize_parameters
from lightning_megatron.pipeline.blocks import PipelineBatch, PipelineBlocks
from lightning_megatron.pipeline.layout import PipelineLayout

IGNORE_INDEX = -100


@dataclass(frozen=True)
class GPTConfig(TransformerSizes):
    """Sizes of a GPT model. ``ffn_hidden_size`` defaults to ``4 * hidden_size``."""

    vocab_size: int = 257
    max_seq_length: int = 128
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    dropout: float = 0.0
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        self._check_heads()

    @classmethod
    def presets(cls) -> dict[str, "GPTConfig"]:
        return GPT_PRESETS

    def num_parameters(self) -> int:
        h, layers = self.hidden_size, self.num_layers
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h * self.ffn_size + self.ffn_size + h
        return self.vocab_size * h + self.max_seq_length * h + layers * per_layer + 2 * h


# Megatron-LM paper (Shoeybi et al. 2019), table 1: hidden, heads, layers; vocab 51,200, sequence 1024.
GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(),
    "gpt2-124m": GPTConfig(vocab_size=50257, max_seq_length=1024, hidden_size=768, num_layers=12, num_heads=12, dropout=0.1, attention_dropout=0.1),
    # GPT-3 XL's sizes (Brown et al. 2020, table 2.1) with Megatron's vocabulary.
    "gpt-1.3b": GPTConfig(vocab_size=51200, max_seq_length=2048, hidden_size=2048, num_layers=24, num_heads=16, dropout=0.1, attention_dropout=0.1),
    **{
        name: GPTConfig(vocab_size=51200, max_seq_length=1024, hidden_size=h, num_heads=heads, num_layers=layers, dropout=0.1, attention_dropout=0.1)
        for name, (h, heads, layers) in {
            "gpt-1.2b": (1536, 16, 40),
            "gpt-2.5b": (1920, 20, 54),
            "gpt-4.2b": (2304, 24, 64),
            "gpt-8.3b": (3072, 32, 72),
        }.items()
    },
}


class GPTEmbedding(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_seq_length, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class GPTModel(nn.Module):
    """Token ids ``[B, S]`` -> logits ``[B, S, V]`` (``V/tp`` under tensor parallelism)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = GPTEmbedding(config)
        # A dict keyed "0", "1", ... (not a list): a pipeline stage keeps only its layers, and their
        # parameter names (blocks.7.mlp.fc.weight) stay global.
        self.blocks = nn.ModuleDict({
            str(index): TransformerLayer(
                config.hidden_size,
                config.num_heads,
                config.ffn_size,
                dropout=config.dropout,
                attention_dropout=config.attention_dropout,
                causal=True,
                layer_norm_eps=config.layer_norm_eps,
            )
            for index in range(config.num_layers)
        })
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.wte.weight
        self.loss_fn = nn.CrossEntropyLoss(reduction="sum", ignore_index=IGNORE_INDEX)
        if not self.embedding.wte.weight.is_meta:
            initialize_parameters(self, seed=torch.initial_seed())

    def initialize_parameter(self, name: str, tensor: Tensor, generator: torch.Generator) -> None:
        """GPT-2 init; output projections of residual branches scaled by 1/sqrt(2 * layers) (Radford et al. 2019)."""
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            tensor.normal_(0.0, INIT_STD / math.sqrt(2 * self.config.num_layers), generator=generator)
        else:
            default_initializer(name, tensor, generator)

    @staticmethod
    def tensor_parallel_plan() -> dict[str, str]:
        return {
            "embedding.wte": "vocab",
            "embedding": "sequence_scatter",
            **layer_tensor_parallel_plan("blocks.*"),
            "ln_f": "sequence_parallel",
            "lm_head": "vocab",
            "loss_fn": "vocab",
        }

    @staticmethod
    def pipeline_blocks() -> PipelineBlocks:
        return PipelineBlocks(first=("embedding",), layers="blocks", last=("ln_f", "lm_head", "loss_fn"))

    # The pipeline protocol (pipeline/blocks.py); forward and loss are built from it.
    def embed(self, input_ids: Tensor) -> Tensor:
        if input_ids.shape[1] > self.config.max_seq_length:
            raise ValueError(
                f"Sequence length {input_ids.shape[1]} exceeds max_seq_length={self.config.max_seq_length} of the model."
            )
        return self.embedding(input_ids)

    def layer_kwargs(self) -> dict:
        return {}

    def head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))

    def pipeline_batch(self, input_ids: Tensor, labels: Tensor) -> PipelineBatch:
        return PipelineBatch(inputs=(input_ids,), target=labels, num_tokens=(labels != IGNORE_INDEX).sum())

    def pipeline_loss(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, dict]:
        return self.loss_fn(logits.flatten(0, 1), labels.flatten()), {}

    def pipeline_result(self, loss_sum: Tensor, num_tokens: Tensor, extras: dict) -> tuple[Tensor, Tensor]:
        return loss_sum, num_tokens

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)

    def loss(self, input_ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """``(sum of token losses, number of counted tokens)``; labels of ``-100`` are ignored."""
        batch = self.pipeline_batch(input_ids, labels)
        loss_sum, extras = self.pipeline_loss(self(input_ids), labels)
        return self.pipeline_result(loss_sum, batch.num_tokens, extras)


class GPT(PretrainingRecipe):
    """A GPT LightningModule to train as is or to subclass.

    Example::

        model = GPT(GPTConfig.from_name("gpt-tiny"))
        trainer = L.Trainer(strategy=Megatron3DStrategy(tensor_parallel_size=2), devices=2)

    ``training_step`` returns ``{"loss", "num_tokens"}``: the strategy uses ``num_tokens`` to
    make the loss a per-token mean over the whole global batch, across micro-batches and
    data-parallel ranks.
    """

    def __init__(
        self,
        config: Union[GPTConfig, str, dict] = "gpt-tiny",
        *,
        learning_rate: float = 1e-3,
        min_learning_rate: float = 1e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        self.init_recipe(GPTConfig, config, learning_rate=learning_rate, min_learning_rate=min_learning_rate,
                         weight_decay=weight_decay, betas=betas, adam_eps=adam_eps, warmup_steps=warmup_steps)
        self.model: Optional[GPTModel] = None
        self.val_loss = MeanMetric()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPTModel(self.config)

    @staticmethod
    def hf_format() -> tuple[Callable, Callable]:
        """``from_hf``/``to_hf`` convert to and from ``transformers.GPT2LMHeadModel``."""
        from lightning_megatron.checkpoint.hf import read_hf_gpt2, write_hf_gpt2  # here: checkpoint.hf imports us

        return read_hf_gpt2, write_hf_gpt2

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {f"model.{pattern}": style for pattern, style in GPTModel.tensor_parallel_plan().items()}

    def pipeline_blocks(self) -> PipelineBlocks:
        return GPTModel.pipeline_blocks().under("model")

    def validate_parallel_config(self, parallel_config) -> None:
        self.config.validate_tensor_parallel_size(parallel_config.tensor_parallel_size)
        PipelineLayout(
            num_layers=self.config.num_layers,
            pipeline_parallel_size=parallel_config.pipeline_parallel_size,
            virtual_pipeline_size=parallel_config.virtual_pipeline_size,
            layers_per_stage=parallel_config.pipeline_layers_per_stage,
        )

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        loss_sum, num_tokens = self.model.loss(batch["input_ids"], batch["labels"])
        loss = loss_sum / num_tokens.clamp(min=1)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return {"loss": loss, "num_tokens": num_tokens}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss_sum, num_tokens = self.model.loss(batch["input_ids"], batch["labels"])
        self.val_loss.update(loss_sum / num_tokens.clamp(min=1), weight=num_tokens)

    def on_validation_epoch_end(self) -> None:
        self._log_held_out("val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        self._log_held_out("test")

    def _log_held_out(self, split: str) -> None:
        """Per-token loss and perplexity over the whole split (the metric syncs over dp)."""
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log(f"{split}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{split}_perplexity", loss.exp(), sync_dist=True)

