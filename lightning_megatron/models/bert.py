"""BERT: a bidirectional encoder trained by masked-language modelling, as a LightningModule.

``BERTModel`` is plain PyTorch: word + position + token-type embeddings, the shared
``TransformerLayer`` without a causal mask (padding masked instead), the masked-LM head tied to
the word embeddings, and an optional sentence-order head on the [CLS] position. ``BERT`` adds
the training recipe and declares what tensor parallelism may split.

``norm_position="pre"`` (the default) is Megatron-LM's BERT: LayerNorm before each sublayer and
a final LayerNorm, which the Megatron-LM paper (Shoeybi et al. 2019, section 5.3) found is what
lets BERT grow past BERT-Large without diverging. ``"post"`` is the original BERT (and Hugging
Face's ``BertModel``): LayerNorm after each residual sum and on the embeddings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_megatron.context_parallel.inputs import SequenceInputs
from lightning_megatron.generation import full_logits
from lightning_megatron.models.batch_flops import BatchFlops
from lightning_megatron.models.flops import bert_flops_per_batch
from lightning_megatron.models.formats import HFFormat, hf_format_for
from lightning_megatron.models.optim_recipe import PretrainingRecipe
from lightning_megatron.models.attention import SelfAttention
from lightning_megatron.models.mlp import MLP
from lightning_megatron.models.transformer import (
    TransformerLayer,
    TransformerSizes,
    layer_recompute_plan,
    layer_tensor_parallel_plan,
)
from lightning_megatron.parallel.initialize import (INIT_STD, default_initializer, initialize_parameters,
                                                    uninitialised_build)
from lightning_megatron.pipeline.blocks import PipelineBatch, PipelineBlocks
from lightning_megatron.pipeline.layout import PipelineLayout
from lightning_megatron.tensor_parallel.argmax import Argmax

IGNORE_INDEX = -100
NORM_POSITIONS = ("pre", "post")
GELU_APPROXIMATIONS = ("none", "tanh")


@dataclass(frozen=True)
class BERTConfig(TransformerSizes):
    """Sizes of a BERT model. ``ffn_hidden_size`` defaults to ``4 * hidden_size``.

    The default (``bert-tiny``) vocabulary is the byte tokenizer's 257 ids plus [PAD], [CLS],
    [SEP] and [MASK] (``lightning_megatron.data.bert.BYTE_SPECIAL_TOKENS``), so it trains on
    the built-in corpus. ``gelu_approximate`` is torch's: ``"none"`` is the exact erf GELU of
    BERT and Megatron-LM, ``"tanh"`` GPT-2's approximation. ``binary_head`` adds the
    sentence-order head (Megatron-LM's BERT; original BERT's next-sentence head has the same shape).
    """

    vocab_size: int = 261
    max_seq_length: int = 512
    type_vocab_size: int = 2
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    dropout: float = 0.0
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    norm_position: str = "pre"
    gelu_approximate: str = "none"
    binary_head: bool = True

    def __post_init__(self) -> None:
        self._check_heads()
        if self.norm_position not in NORM_POSITIONS:
            raise ValueError(
                f"norm_position={self.norm_position!r} is not one of {NORM_POSITIONS}: 'pre' is Megatron-LM's BERT, "
                f"'post' the original BERT (Hugging Face)."
            )
        if self.gelu_approximate not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"gelu_approximate={self.gelu_approximate!r} is not one of {GELU_APPROXIMATIONS} "
                f"(torch.nn.functional.gelu's `approximate`)."
            )

    @classmethod
    def presets(cls) -> dict[str, "BERTConfig"]:
        return BERT_PRESETS

    def flops_per_batch(self, batch_size: int, seq_length: int) -> int:
        """Training FLOPs of a batch (``models/flops.py``'s :func:`bert_flops_per_batch`)."""
        return bert_flops_per_batch(self, batch_size, seq_length)


# Megatron-LM paper (Shoeybi et al. 2019), section 5.3: hidden, heads, layers. The vocabulary is BERT's
# 30,522 uncased WordPiece ids, unpadded: the strategy pads it to a multiple of tp * 128 at run time, as
# Megatron-LM does (30,720 at tp=8), and never predicts the padding. (Megatron-LM's released BERT
# checkpoints use the 28,996-id cased vocabulary, padded to 29,056: pass vocab_size=28996 for those.)
BERT_PRESETS: dict[str, BERTConfig] = {
    "bert-tiny": BERTConfig(),
    **{
        name: BERTConfig(vocab_size=30522, hidden_size=h, num_heads=heads, num_layers=layers, dropout=0.1,
                         attention_dropout=0.1)
        for name, (h, heads, layers) in {
            "bert-base": (768, 12, 12),
            "bert-large": (1024, 16, 24),
            "bert-1.3b": (2048, 32, 24),
            "bert-3.9b": (2560, 40, 48),
        }.items()
    },
}


class BERTOutput(NamedTuple):
    logits: Tensor  # [B, S, V] masked-LM logits ([B, S, V/tp] under tensor parallelism)
    binary_logits: Optional[Tensor]  # [B, 2] sentence-order logits, None without the binary head


class BERTLoss(NamedTuple):
    """Sums over one batch; the training objective is ``loss_sum / num_tokens``."""

    loss_sum: Tensor  # masked-LM loss summed over masked tokens, plus the weighted sentence-order loss
    num_tokens: Tensor  # masked tokens: the count the strategy averages over, across micro-batches and dp
    mlm_loss_sum: Tensor
    num_correct: Tensor  # masked tokens whose most likely id (over the full vocabulary) is the label
    sentence_order_loss: Optional[Tensor]  # mean over samples, detached, for logging


class BERTEmbedding(nn.Module):
    """Word + position + token-type embeddings; post-norm BERT also normalises their sum."""

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_seq_length, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        post = config.norm_position == "post"
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if post else None
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) if position_ids is None else position_ids
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids) + self.position_embeddings(positions)
        return self.drop(x if self.norm is None else self.norm(x))


class MaskedLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> ``decoder``, whose weight BERTModel ties to the word embeddings.

    The decoder keeps BERT's per-token output bias; under tensor parallelism it is split (and
    padded) with the vocabulary, like the weight.
    """

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.gelu_approximate = config.gelu_approximate

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(x), approximate=self.gelu_approximate)))


class Pooler(nn.Module):
    """``tanh(dense(h[CLS]))``: the summary of the sequence that the sentence-order head classifies."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden_states[:, 0]))


class BERTModel(nn.Module):
    """Token ids ``[B, S]`` -> :class:`BERTOutput` (masked-LM logits, optional sentence-order logits).

    ``attention_mask`` is ``[B, S]`` with 1 for real tokens and 0 for padding (Hugging Face's
    convention); padded keys are never attended to. ``token_type_ids`` default to 0 (segment A).
    """

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.config = config
        with uninitialised_build():  # initialize_parameters (below, or the strategy's) sets every parameter
            self.embeddings = BERTEmbedding(config)
            # Keyed "0", "1", ... like GPTModel.blocks: parameter names stay blocks.7.mlp.fc.weight.
            self.blocks = nn.ModuleDict({
                str(index): TransformerLayer(
                    SelfAttention(config.hidden_size, config.num_heads, attention_dropout=config.attention_dropout,
                                  causal=False),
                    MLP(config.hidden_size, config.ffn_size, gelu_approximate=config.gelu_approximate),
                    partial(nn.LayerNorm, config.hidden_size, eps=config.layer_norm_eps),
                    dropout=config.dropout,
                    norm_position=config.norm_position,
                )
                for index in range(config.num_layers)
            })
            pre = config.norm_position == "pre"
            self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if pre else None
            self.mlm_head = MaskedLMHead(config)
            self.mlm_head.decoder.weight = self.embeddings.word_embeddings.weight
            self.pooler = Pooler(config.hidden_size) if config.binary_head else None
            self.binary_head = nn.Linear(config.hidden_size, 2) if config.binary_head else None
        self.loss_fn = nn.CrossEntropyLoss(reduction="sum", ignore_index=IGNORE_INDEX)
        self.argmax = Argmax()
        if not self.embeddings.word_embeddings.weight.is_meta:
            initialize_parameters(self, seed=torch.initial_seed())

    def initialize_parameter(self, name: str, tensor: Tensor, generator: torch.Generator) -> None:
        """N(0, 0.02) weights, zero biases, unit LayerNorm gains (BERT); residual-branch output
        projections scaled by 1/sqrt(2 * layers), as Megatron-LM initialises its BERT and GPT."""
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            tensor.normal_(0.0, INIT_STD / math.sqrt(2 * self.config.num_layers), generator=generator)
        else:
            default_initializer(name, tensor, generator)

    @staticmethod
    def tensor_parallel_plan(config: BERTConfig) -> dict[str, str]:
        """What may be split. Under sequence parallelism the pooler gathers the sequence back,
        because [CLS] lives in tensor-parallel rank 0's chunk; the masked-LM head works on chunks."""
        plan = {
            "embeddings.word_embeddings": "vocab",
            "embeddings": "sequence_scatter",
            **layer_tensor_parallel_plan("blocks.*", num_heads=config.num_heads),
            "mlm_head": "sequence_parallel",
            "mlm_head.decoder": "vocab",
            "loss_fn": "vocab",
            "argmax": "vocab",
        }
        if config.norm_position == "pre":
            plan["ln_f"] = "sequence_parallel"
        if config.binary_head:
            plan["pooler"] = "sequence_gather"
        return plan

    @staticmethod
    def recompute_plan() -> dict[str, str]:
        return layer_recompute_plan("blocks.*")

    @staticmethod
    def pipeline_blocks() -> PipelineBlocks:
        return PipelineBlocks(first=("embeddings",), layers="blocks",
                              last=("ln_f", "mlm_head", "pooler", "binary_head", "loss_fn", "argmax"))

    # The pipeline protocol (pipeline/blocks.py); forward and loss are built from it.
    def embed(self, input_ids: Tensor, *, token_type_ids: Optional[Tensor] = None,
              position_ids: Optional[Tensor] = None, **side: Tensor) -> Tensor:
        if input_ids.shape[1] > self.config.max_seq_length:
            raise ValueError(
                f"Sequence length {input_ids.shape[1]} exceeds max_seq_length={self.config.max_seq_length} of the model."
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        return self.embeddings(input_ids, token_type_ids, position_ids)

    def layer_kwargs(self, *, attention_mask: Optional[Tensor] = None, **side: Tensor) -> dict:
        # [B, 1, 1, S] booleans, True = attend: broadcast over heads and query positions.
        return {"attention_mask": None if attention_mask is None else attention_mask.bool()[:, None, None, :]}

    def head(self, x: Tensor, *, sentence_order_labels: Optional[Tensor] = None, **side: Tensor):
        """``(masked-LM logits, sentence-order logits, sentence-order labels)``, or ``(masked-LM logits,)`` without
        the sentence-order head: all the loss needs."""
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.binary_head is None:  # tensors only: a pipeline stage's outputs may not hold None
            return (self.mlm_head(x),)
        return self.mlm_head(x), self.binary_head(self.pooler(x)), sentence_order_labels

    def pipeline_batch(
        self,
        input_ids: Tensor,
        labels: Tensor,
        *,
        attention_mask: Optional[Tensor] = None,
        token_type_ids: Optional[Tensor] = None,
        sentence_order_labels: Optional[Tensor] = None,
        position_ids: Optional[Tensor] = None,
    ) -> PipelineBatch:
        """``position_ids``: the tokens' positions when they are not ``0..S-1`` (a context-parallel rank's chunks)."""
        if self.config.binary_head and sentence_order_labels is None:
            raise ValueError(
                "This BERT has a sentence-order head (binary_head=True) but the batch has no sentence-order labels: "
                "use BERTDataModule(sentence_order=True) or BERTConfig(binary_head=False)."
            )
        side = {"attention_mask": attention_mask, "token_type_ids": token_type_ids,
                "sentence_order_labels": sentence_order_labels, "position_ids": position_ids}
        return PipelineBatch(inputs=(input_ids,), target=labels, num_tokens=(labels != IGNORE_INDEX).sum(),
                             side={name: value for name, value in side.items() if value is not None})

    def pipeline_loss(self, outputs, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Masked-LM loss over the positions whose label is not -100, plus the sentence-order loss.

        A sample's sentence-order loss is weighted by its number of masked tokens, so the whole
        objective is a per-masked-token mean, which the strategy averages exactly over
        micro-batches and data-parallel ranks (a per-sample mean would change with the layout
        whenever ranks hold different numbers of masked tokens). With samples of equal length
        every weight is the same and this is the usual per-sample mean.
        """
        logits, binary_logits, sentence_order_labels = _head_outputs(outputs)
        masked = labels != IGNORE_INDEX
        mlm_loss_sum = self.loss_fn(logits.flatten(0, 1), labels.flatten())
        extras = {"mlm_loss_sum": mlm_loss_sum.detach(),
                  "num_correct": ((self.argmax(logits.detach()) == labels) & masked).sum()}
        loss_sum = mlm_loss_sum
        if binary_logits is not None:
            per_sample = F.cross_entropy(binary_logits.float(), sentence_order_labels, reduction="none")
            loss_sum = loss_sum + (per_sample * masked.sum(dim=1)).sum()
            extras["sentence_order_loss_sum"] = per_sample.detach().sum()
            extras["samples"] = torch.tensor(float(len(per_sample)), device=per_sample.device)
        return loss_sum, extras

    def pipeline_result(self, loss_sum: Tensor, num_tokens: Tensor, extras: dict[str, Tensor]) -> BERTLoss:
        sentence_order_loss = None
        if "samples" in extras:
            sentence_order_loss = extras["sentence_order_loss_sum"] / extras["samples"]
        return BERTLoss(loss_sum, num_tokens, extras["mlm_loss_sum"], extras["num_correct"], sentence_order_loss)

    def _run(self, input_ids: Tensor, side: dict[str, Tensor]):
        x = self.embed(input_ids, **side)
        layer_kwargs = self.layer_kwargs(**side)
        for block in self.blocks.values():
            x = block(x, **layer_kwargs)
        return self.head(x, **side)

    def forward(
        self, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None, token_type_ids: Optional[Tensor] = None
    ) -> BERTOutput:
        side = {"attention_mask": attention_mask, "token_type_ids": token_type_ids}
        logits, binary_logits, _ = _head_outputs(self._run(input_ids, {k: v for k, v in side.items() if v is not None}))
        return BERTOutput(logits, binary_logits)

    def loss(self, input_ids: Tensor, labels: Tensor, **kwargs: Optional[Tensor]) -> BERTLoss:
        """See :meth:`pipeline_batch` for the keyword arguments and :meth:`pipeline_loss` for the objective."""
        batch = self.pipeline_batch(input_ids, labels, **kwargs)
        loss_sum, extras = self.pipeline_loss(self._run(input_ids, batch.side), labels)
        return self.pipeline_result(loss_sum, batch.num_tokens, extras)


def _head_outputs(outputs) -> tuple:
    """:meth:`BERTModel.head`'s outputs as three (None where there is no sentence-order head); a pipeline stage
    hands a one-tensor output over as the tensor."""
    outputs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
    return (*outputs, None, None)[:3]


class BERT(BatchFlops, PretrainingRecipe):
    """A BERT LightningModule to pre-train as is or to subclass.

    Example::

        model = BERT(BERTConfig.from_name("bert-tiny"))
        trainer = L.Trainer(strategy=Megatron3DStrategy(tensor_parallel_size=2), devices=2)
        trainer.fit(model, datamodule=BERTDataModule(seq_length=128, global_batch_size=16))

    Batches are what :class:`~lightning_megatron.data.BERTDataModule` yields: ``input_ids``,
    ``labels`` (-100 where not masked), ``attention_mask``, ``token_type_ids`` and, for the
    sentence-order head, ``sentence_order_label``. ``training_step`` returns ``{"loss",
    "num_tokens"}`` with the number of masked tokens, so the strategy averages the loss over
    the masked tokens of the whole global batch. Logged: ``train_loss`` (the objective),
    ``train_accuracy`` (masked tokens predicted right), ``val_loss`` (masked-LM only),
    ``val_accuracy``, and the sentence-order loss when the head is on.
    """

    def __init__(
        self,
        config: Union[BERTConfig, str, dict] = "bert-tiny",
        *,
        learning_rate: float = 1e-3,
        min_learning_rate: float = 1e-4,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        warmup_steps: int = 20,
        adam_implementation: str = "auto",
    ) -> None:
        super().__init__()
        self.init_recipe(BERTConfig, config, learning_rate=learning_rate, min_learning_rate=min_learning_rate,
                         weight_decay=weight_decay, betas=betas, adam_eps=adam_eps, warmup_steps=warmup_steps,
                         adam_implementation=adam_implementation)
        self.model: Optional[BERTModel] = None
        self.val_loss, self.val_accuracy = MeanMetric(), MeanMetric()
        self.val_sentence_order_loss = MeanMetric() if self.config.binary_head else None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = BERTModel(self.config)

    @staticmethod
    def hf_format() -> HFFormat:
        """``from_hf``/``to_hf`` convert to and from ``transformers.BertForPreTraining`` (or ``BertForMaskedLM``:
        the sentence-order head comes with the weights). Only a post-norm BERT (``BERTConfig(norm_position="post")``)
        has a Hugging Face twin; pass ``pad_token_id`` to ``to_hf`` for a tokenizer with padding."""
        return hf_format_for(BERTConfig)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {f"model.{pattern}": style for pattern, style in BERTModel.tensor_parallel_plan(self.config).items()}

    @staticmethod
    def recompute_plan() -> dict[str, str]:
        return {f"model.{pattern}": mode for pattern, mode in BERTModel.recompute_plan().items()}

    def pipeline_blocks(self) -> PipelineBlocks:
        return BERTModel.pipeline_blocks().under("model")

    def validate_parallel_config(self, parallel_config) -> None:
        self.config.validate_tensor_parallel_size(parallel_config.tensor_parallel_size)
        if parallel_config.context_parallel_size > 1 and self.config.binary_head:
            raise ValueError(
                f"context_parallel_size={parallel_config.context_parallel_size} splits each sequence over ranks, and "
                f"the sentence-order head reads [CLS] from one of them and weights each sample by its masked tokens "
                f"on all of them; that is not supported. Use BERTConfig(binary_head=False) (masked-LM only, as "
                f"RoBERTa trains) and BERTDataModule(sentence_order=False), or context_parallel_size=1.")
        PipelineLayout(
            num_layers=self.config.num_layers,
            pipeline_parallel_size=parallel_config.pipeline_parallel_size,
            virtual_pipeline_size=parallel_config.virtual_pipeline_size,
            layers_per_stage=parallel_config.pipeline_layers_per_stage,
        )

    def sequence_inputs(self) -> SequenceInputs:
        """How context parallelism cuts a batch: tokens, labels and token types by position, the padding mask kept
        whole (every rank's attention reads every key's)."""
        return SequenceInputs(split=("input_ids", "labels", "token_type_ids"), key_masks=("attention_mask",),
                              max_length=self.config.max_seq_length)

    def forward(self, input_ids: Tensor, **kwargs: Tensor) -> BERTOutput:
        return self.model(input_ids, **kwargs)

    def _loss(self, batch: dict[str, Tensor]) -> BERTLoss:
        return self.model.loss(
            batch["input_ids"],
            batch["labels"],
            attention_mask=batch.get("attention_mask"),
            token_type_ids=batch.get("token_type_ids"),
            sentence_order_labels=batch.get("sentence_order_label"),
            position_ids=batch.get("position_ids"),
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        out = self._loss(batch)
        num_tokens = out.num_tokens.clamp(min=1)
        loss = out.loss_sum / num_tokens
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_accuracy", out.num_correct / num_tokens, sync_dist=True)
        if out.sentence_order_loss is not None:
            self.log("train_sentence_order_loss", out.sentence_order_loss, sync_dist=True)
        return {"loss": loss, "num_tokens": out.num_tokens}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self._loss(batch)
        num_tokens = out.num_tokens.clamp(min=1)
        self.val_loss.update(out.mlm_loss_sum / num_tokens, weight=num_tokens)
        self.val_accuracy.update(out.num_correct / num_tokens, weight=num_tokens)
        if out.sentence_order_loss is not None:
            self.val_sentence_order_loss.update(out.sentence_order_loss, weight=len(batch["input_ids"]))

    def on_validation_epoch_end(self) -> None:
        self._log_held_out("val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        self._log_held_out("test")

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int = 0) -> dict[str, Tensor]:
        """Masked-token prediction: ``{"logits": [B, S, vocab_size] fp32 over the whole, unpadded vocabulary,
        "predictions": [B, S] the most likely id}`` at every position (read them where ``input_ids`` holds
        ``[MASK]``), on every rank at every layout; ``attention_mask`` and ``token_type_ids`` as in training."""
        side = {name: batch[name] for name in ("attention_mask", "token_type_ids") if batch.get(name) is not None}
        logits = full_logits(self.model, batch["input_ids"], head="mlm_head.decoder", **side)
        return {"logits": logits, "predictions": logits.argmax(dim=-1)}

    def _log_held_out(self, split: str) -> None:
        metrics = {"loss": self.val_loss, "accuracy": self.val_accuracy, "sentence_order_loss": self.val_sentence_order_loss}
        for name, metric in metrics.items():
            if metric is not None:
                self.log(f"{split}_{name}", metric.compute(), prog_bar=name == "loss", sync_dist=True)
                metric.reset()

