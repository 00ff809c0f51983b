"""GPT: a pre-norm decoder in the style of GPT-2 and Megatron-LM, as a LightningModule.

``GPTModel`` is plain PyTorch (readable like nanoGPT); ``GPT`` adds the training recipe
(per-token loss, AdamW, warmup + cosine) and declares what tensor parallelism may split.
Under ``Megatron3DStrategy`` the model is built on the meta device in ``configure_model``
and only this rank's shards are ever materialised.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import ContextManager, Mapping, Optional, Union

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_megatron.context_parallel.documents import DocumentMask
from lightning_megatron.context_parallel.inputs import SequenceInputs
from lightning_megatron.generation import full_logits, generate
from lightning_megatron.models.attention import SelfAttention
from lightning_megatron.models.batch_flops import BatchFlops
from lightning_megatron.models.flops import gpt_flops_per_batch
from lightning_megatron.models.formats import HFFormat, hf_format_for
from lightning_megatron.models.latent_attention import MLAConfig, MultiLatentAttention, mla_tensor_parallel_plan
from lightning_megatron.models.mlp import ACTIVATIONS, build_mlp, is_gated
from lightning_megatron.models.moe import MoE, AuxLosses, MoEConfig, moe_tensor_parallel_plan, update_expert_biases
from lightning_megatron.models.multi_token_prediction import MTPConfig, MultiTokenPrediction, shifted_labels, shifted_tokens
from lightning_megatron.models.norms import NORMALIZATIONS, build_norm
from lightning_megatron.models.optim_recipe import PretrainingRecipe, load_base_weights
from lightning_megatron.models.router import routing_uncounted
from lightning_megatron.models.rotary import RopeScaling, RotaryEmbedding
from lightning_megatron.models.transformer import (
    NORM_POSITIONS,
    TransformerLayer,
    TransformerSizes,
    layer_fused_projections,
    layer_recompute_plan,
    layer_tensor_parallel_plan,
)
from lightning_megatron.parallel.initialize import (INIT_STD, default_initializer, initialize_parameters,
                                                    uninitialised_build)
from lightning_megatron.parallel.names import ADAPTER_MODULES, is_adapter_name
from lightning_megatron.peft.adapters import adapted_layers
from lightning_megatron.peft.lora import LoRAConfig, apply_lora
from lightning_megatron.peft.nf4 import quantize_in_place
from lightning_megatron.pipeline.blocks import PipelineBatch, PipelineBlocks
from lightning_megatron.pipeline.layout import SCHEDULE_SPECS, PipelineLayout
from lightning_megatron.tensor_parallel.chunked_cross_entropy import ChunkedHeadLoss, check_chunk_tokens
from lightning_megatron.tensor_parallel.logits import soft_cap

IGNORE_INDEX = -100
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
#: The layer's norm orders a decoder may use (``TransformerLayer``'s but the post-norm one, a BERT's).
GPT_NORM_POSITIONS = tuple(position for position in NORM_POSITIONS if position != "post")
#: ``GPTConfig.layer_types`` values, transformers' names: attention over every earlier key, or a sliding window.
ATTENTION_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class GPTConfig(TransformerSizes):
    """Sizes and pieces of a decoder; the defaults are GPT-2's (``ffn_hidden_size`` defaults to ``4 * hidden_size``).

    The pieces, with Megatron-Core's names where it has one:

    * ``normalization``: ``"LayerNorm"`` (GPT-2), ``"RMSNorm"`` (Llama, Mistral, Qwen2) or ``"ZeroCenteredRMSNorm"``
      (Gemma: the gain stored as its offset from one, ``(1 + weight)``, starting at zero; ``models.norms``). Every
      norm of the model is of this kind, the q/k norms too.
    * ``position_embedding_type``: ``"learned_absolute"`` (a ``wpe`` table, GPT-2) or ``"rope"``
      (rotary, base ``rotary_base``; ``rope_scaling`` for Llama-3.1's long-context frequencies).
    * ``activation``: ``"gelu"`` (tanh GELU MLP), ``"swiglu"`` (gated SiLU) or ``"geglu"`` (gated tanh GELU,
      Gemma's); for the gated two ``ffn_hidden_size`` is the width of each of gate and up.
    * ``num_query_groups``: key/value heads for grouped-query attention (1: multi-query; None:
      ``num_heads``, multi-head).
    * ``kv_channels``: the width of each attention head (``head_dim``), when it is not ``hidden_size /
      num_heads`` (Qwen3: 128 at every size); the projections are then ``num_heads * kv_channels`` wide. The
      default width given explicitly is stored as None, so that configs of one model compare equal.
    * ``qk_layernorm``: an RMSNorm over each query and key head before rotary positions (Qwen3's ``q_norm`` and
      ``k_norm``: one gain of ``head_dim`` shared by all heads).
    * ``add_bias_linear``: biases on every linear layer; ``add_qkv_bias``: a bias on ``qkv`` even
      without them (Qwen2).
    * ``tie_embeddings``: the output layer shares the input embedding's weights.
    * ``moe``: a :class:`~lightning_megatron.models.moe.MoEConfig` (or a dict of its fields) makes the MLP
      of every (or every ``layer_freq``-th) layer a Mixture of Experts; None: dense.
    * ``loss_chunk_tokens``: the loss runs the output layer and the cross-entropy fused, this many tokens of
      logits at a time (``tensor_parallel.chunked_cross_entropy``), so that the logits of a whole micro-batch are
      never held; same loss and gradients, one more head GEMM per token in backward. None (the default, as in
      Megatron-Core): the head's logits, then the cross-entropy. Forward, generation and prediction return
      logits either way.
    * ``norm_position``: ``"pre"`` (a norm before attention and before the MLP) or ``"sandwich"`` (also one after
      each, on the branch's output before the residual add: Gemma's four norms per layer;
      ``models.transformer.TransformerLayer``).
    * ``embedding_multiplier``: the token embeddings are multiplied by it (Gemma: ``sqrt(hidden_size)``), in the
      embedding's dtype as transformers does (in bf16, ``sqrt(3072)`` is 55.5); None: not scaled.
    * ``final_logit_softcapping``: the logits become ``cap * tanh(logits / cap)`` (Gemma 2: 30.0), wherever they are
      made (forward, generation, the loss, the chunked loss); None: not capped.
    * ``sliding_window``: a sliding layer's query sees the ``sliding_window`` keys ending at its own position
      (transformers' ``kv_idx > q_idx - sliding_window``), at any sequence length, with packed documents, context
      parallelism and the KV cache. ``layer_types``: per layer ``"full_attention"`` or ``"sliding_attention"``
      (transformers' names; None: every layer sliding when ``sliding_window`` is set, else every layer full).
    * ``rotary_base_local``: the rotary base of sliding layers, which then also go without ``rope_scaling``
      (Gemma 3's ``rope_local_base_freq``); None: every layer uses ``rotary_base`` and ``rope_scaling``.
    * ``softmax_scale``: the factor of ``q k^T`` (Gemma 3: ``query_pre_attn_scalar ** -0.5``; DeepSeek-V3 under YaRN
      with ``mscale_all_dim``: ``MLAConfig.softmax_scale(rope_scaling)``); None: ``1 / sqrt(head_dim)``.
    * ``attn_logit_softcapping``: scores become ``cap * tanh(scores / cap)`` before the mask and softmax (Gemma 2).
      That attention keeps its ``[S, S]`` probabilities for backward (``models.softcap``) and is refused under
      context parallelism; None: none.
    * ``mla``: an :class:`~lightning_megatron.models.latent_attention.MLAConfig` (or a dict of its fields) makes every
      attention multi-head latent attention (DeepSeek-V2/V3: queries, keys and values from low-rank latents, one
      rotary key shared by the heads; ``models.latent_attention``), with rotary positions and without
      ``num_query_groups``, ``kv_channels``, ``qk_layernorm`` or ``add_qkv_bias``; None: ``SelfAttention``.
    * ``add_attention_bias``: biases on the attention's ``qkv`` and ``proj`` but not on the MLP (GPT-OSS's
      ``attention_bias``; ``add_bias_linear`` puts them on every linear layer, ``add_qkv_bias`` on ``qkv`` alone).
    * ``attention_sinks``: every attention head has a learned sink logit in its softmax's denominator (GPT-OSS's
      ``sinks``): merged last into the block attention's online softmax in training (``context_parallel.local``:
      windows and packed documents, O(S) memory), the dense path of ``models.softcap`` with a KV cache. Split with
      the query heads over tensor-parallel ranks (``"per_head"``); merged once, after every rank's keys, by context
      parallelism's ring and all-gather attention (``context_parallel.blocks.merge_sinks``).
    * ``mtp``: an :class:`~lightning_megatron.models.multi_token_prediction.MTPConfig` (or a dict of its fields) adds
      DeepSeek-V3's multi-token prediction to training (Megatron-Core's ``mtp_num_layers``,
      ``mtp_loss_scaling_factor``): ``num_layers`` depths of one layer each, of the kind of the model's last layer
      (dense or MoE), sharing the embedding and the output head; their loss enters the gradient only (``mtp_loss`` is
      logged apart). None (the default): none. The Hugging Face conversions leave the depths out (transformers
      drops DeepSeek-V3's ``model.layers.61.*`` when it loads one).
    """

    vocab_size: int = 257
    max_seq_length: int = 128
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    dropout: float = 0.0
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    activation: str = "gelu"
    num_query_groups: Optional[int] = None
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    tie_embeddings: bool = True
    kv_channels: Optional[int] = None
    qk_layernorm: bool = False
    moe: Optional[MoEConfig] = None
    loss_chunk_tokens: Optional[int] = None
    norm_position: str = "pre"
    embedding_multiplier: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    sliding_window: Optional[int] = None
    layer_types: Optional[tuple[str, ...]] = None
    rotary_base_local: Optional[float] = None
    softmax_scale: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    mla: Optional[MLAConfig] = None
    add_attention_bias: bool = False
    attention_sinks: bool = False
    mtp: Optional[MTPConfig] = None

    def __post_init__(self) -> None:
        if self.kv_channels is None:
            self._check_heads()
        elif self.kv_channels < 1:
            raise ValueError(f"GPTConfig.kv_channels={self.kv_channels}: a head needs at least one channel; None "
                             f"gives hidden_size / num_heads.")
        elif self.kv_channels * self.num_heads == self.hidden_size:
            object.__setattr__(self, "kv_channels", None)  # the default width: one spelling of one model
        if self.loss_chunk_tokens is not None:
            check_chunk_tokens(self.loss_chunk_tokens, name="GPTConfig.loss_chunk_tokens")
        if isinstance(self.rope_scaling, dict):  # from YAML / a dict config
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.moe is not None:
            self.moe.moe_layers(self.num_layers)  # checks a 0/1 pattern's length
        choices = {"normalization": NORMALIZATIONS, "position_embedding_type": POSITION_EMBEDDINGS,
                   "activation": ACTIVATIONS, "norm_position": GPT_NORM_POSITIONS}
        for field, valid in choices.items():
            if getattr(self, field) not in valid:
                raise ValueError(f"GPTConfig.{field}={getattr(self, field)!r} is not one of {valid}.")
        if self.num_heads % self.query_groups:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_query_groups={self.num_query_groups}: each "
                f"key/value head serves the same number of query heads. Use num_query_groups in "
                f"{[g for g in range(1, self.num_heads + 1) if self.num_heads % g == 0]}.")
        if self.position_embedding_type == "rope" and self.mla is None and self.head_dim % 2:  # (mla: its own check)
            width = "kv_channels" if self.kv_channels else f"hidden_size / num_heads = {self.hidden_size} / {self.num_heads}"
            raise ValueError(
                f"Rotary positions rotate pairs of channels, but head_dim = {width} = {self.head_dim} is odd. Choose "
                f"an even head_dim or position_embedding_type='learned_absolute'.")
        for field in ("embedding_multiplier", "final_logit_softcapping"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ValueError(f"GPTConfig.{field}={value!r} must be a positive number, or None to leave it out.")
        if self.rope_scaling is not None and self.position_embedding_type != "rope":
            raise ValueError("rope_scaling scales rotary frequencies: set position_embedding_type='rope' or drop it.")
        self._check_attention_types()
        self._check_latent_attention()
        if isinstance(self.mtp, dict):
            object.__setattr__(self, "mtp", MTPConfig(**self.mtp))

    def _check_latent_attention(self) -> None:
        """``mla``: a dict (YAML) made an ``MLAConfig``; the attention fields it replaces must be left unset."""
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MLAConfig(**self.mla))
        if self.mla is None:
            return
        clashes = [f"{name}={getattr(self, name)!r}" for name, unset in
                   (("num_query_groups", None), ("kv_channels", None), ("qk_layernorm", False),
                    ("add_qkv_bias", False)) if getattr(self, name) != unset]
        if self.position_embedding_type != "rope":
            clashes.append(f"position_embedding_type={self.position_embedding_type!r}")
        if clashes:
            raise ValueError(f"GPTConfig.mla gives every head its own keys and values from latents and rotary "
                             f"positions on qk_rope_head_dim channels, so {', '.join(clashes)} has no meaning with "
                             f"it: leave num_query_groups, kv_channels, add_qkv_bias unset, qk_layernorm=False and "
                             f"use position_embedding_type='rope'.")

    def _check_attention_types(self) -> None:
        """``sliding_window``, ``layer_types`` (a YAML list made a tuple; the default pattern stored as None, one
        spelling of one model), ``rotary_base_local``, ``softmax_scale`` and ``attn_logit_softcapping``."""
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"GPTConfig.sliding_window={self.sliding_window}: a query sees the keys less than "
                             f"sliding_window positions before it, itself included, so it must be >= 1 (None: no window).")
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", types)
            unknown = sorted({kind for kind in types if kind not in ATTENTION_TYPES})
            if unknown:
                raise ValueError(f"GPTConfig.layer_types has {unknown}: each layer's attention is one of "
                                 f"{ATTENTION_TYPES} (transformers' names).")
            if len(types) != self.num_layers:
                raise ValueError(f"GPTConfig.layer_types names {len(types)} layers but num_layers={self.num_layers}: "
                                 f"give one attention type per layer.")
            if "sliding_attention" in types and self.sliding_window is None:
                raise ValueError(f"GPTConfig.layer_types has sliding_attention layers "
                                 f"{[i for i, kind in enumerate(types) if kind == 'sliding_attention']} but "
                                 f"sliding_window=None: set the window's size, or make them 'full_attention'.")
            default = ("sliding_attention" if self.sliding_window is not None else "full_attention",) * self.num_layers
            if types == default:
                object.__setattr__(self, "layer_types", None)
        if self.rotary_base_local is not None and self.position_embedding_type != "rope":
            raise ValueError("rotary_base_local is the rotary base of sliding-window layers: set "
                             "position_embedding_type='rope' or drop it.")
        for field in ("softmax_scale", "attn_logit_softcapping"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"GPTConfig.{field}={value} must be positive (None: "
                                 f"{'1 / sqrt(head_dim)' if field == 'softmax_scale' else 'no soft-capping'}).")

    def attention_type(self, index: int) -> str:
        """Layer ``index``'s attention: ``"sliding_attention"`` (a window of ``sliding_window`` keys) or
        ``"full_attention"`` (``layer_types``; by default every layer sliding when ``sliding_window`` is set)."""
        if self.layer_types is not None:
            return self.layer_types[index]
        return "sliding_attention" if self.sliding_window is not None else "full_attention"

    def attention_window(self, index: int) -> Optional[int]:
        """The keys layer ``index``'s queries see, counting back from their own position: ``sliding_window`` for a
        sliding layer, None (all earlier keys) for a full one."""
        return self.sliding_window if self.attention_type(index) == "sliding_attention" else None

    def rotary_of(self, index: int) -> tuple[float, Optional[RopeScaling]]:
        """``(base, scaling)`` of layer ``index``'s rotary positions. A sliding layer with ``rotary_base_local``
        set uses that base and no scaling (Gemma 3's local layers: theta 10,000, unscaled, while its global layers
        carry the long-context scaling); otherwise every layer uses ``rotary_base`` and ``rope_scaling``."""
        if self.rotary_base_local is not None and self.attention_type(index) == "sliding_attention":
            return self.rotary_base_local, None
        return self.rotary_base, self.rope_scaling

    @classmethod
    def presets(cls) -> dict[str, "GPTConfig"]:
        return GPT_PRESETS

    @property
    def head_dim(self) -> int:
        """Channels of one attention head: ``kv_channels``, by default ``hidden_size / num_heads``."""
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads (``num_query_groups``, or ``num_heads`` for multi-head attention)."""
        return self.num_query_groups or self.num_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias or self.add_attention_bias

    @property
    def proj_bias(self) -> bool:
        """A bias on the attention's output projection (``add_bias_linear`` or ``add_attention_bias``)."""
        return self.add_bias_linear or self.add_attention_bias

    def validate_expert_layout(self, tensor_parallel_size: int, expert_parallel_size: int) -> None:
        """Experts split over ``expert_parallel_size`` ranks and each expert over ``tensor_parallel_size``."""
        tp, ep = tensor_parallel_size, expert_parallel_size
        if self.moe is None:
            if ep > 1:
                raise ValueError(f"expert_parallel_size={ep} splits the experts of Mixture-of-Experts layers, but this "
                                 f"GPTConfig has moe=None. Set GPTConfig(moe=MoEConfig(num_experts=...)) or use "
                                 f"expert_parallel_size=1.")
            return
        if self.moe.num_experts % ep:
            raise ValueError(f"expert_parallel_size={ep} does not divide num_experts={self.moe.num_experts}: every "
                             f"expert-parallel rank holds the same number of experts. Use one of "
                             f"{[d for d in range(1, self.moe.num_experts + 1) if self.moe.num_experts % d == 0]}.")
        widths = {"MoEConfig.ffn_hidden_size": self.moe_ffn_size, "MoEConfig.shared_expert_size": self.moe.shared_expert_size}
        problems = [f"{name}={width}" for name, width in widths.items() if width % tp]
        if problems:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {' and '.join(problems)}: each expert is split "
                             f"over tp like a dense MLP. Choose widths divisible by {tp} or a smaller tensor_parallel_size.")

    @property
    def moe_ffn_size(self) -> int:
        """Width of each routed expert (``moe.ffn_hidden_size``, else ``ffn_size``)."""
        return (self.moe.ffn_hidden_size if self.moe is not None else None) or self.ffn_size

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index, self.num_layers)

    @property
    def mtp_layer_index(self) -> int:
        """The decoder layer whose kind (dense or MoE, attention window, rotary base) each multi-token prediction
        depth's layer takes: the last one (DeepSeek-V3's depth is an MoE layer, as its last layers are)."""
        return self.num_layers - 1

    def flops_per_batch(self, batch_size: int, seq_length: int) -> int:
        """Training FLOPs of a batch (``models/flops.py``'s :func:`gpt_flops_per_batch`)."""
        return gpt_flops_per_batch(self, batch_size, seq_length)

    def num_parameters(self) -> int:
        """All parameters (every expert counted); ``num_active_parameters`` counts those one token uses."""
        return self._count_parameters(active=False)

    def num_active_parameters(self) -> int:
        """Parameters one token's forward uses: the ``top_k`` routed experts of an MoE layer, not all of them."""
        return self._count_parameters(active=True)

    def _count_parameters(self, *, active: bool) -> int:
        h, ffn, bias = self.hidden_size, self.ffn_size, self.add_bias_linear
        norm = 2 * h if self.normalization == "LayerNorm" else h
        norms_per_layer = 4 if self.norm_position == "sandwich" else 2
        qkv_rows = (self.num_heads + 2 * self.query_groups) * self.head_dim
        attention = qkv_rows * (h + self.qkv_bias) + h * self.num_heads * self.head_dim + h * self.proj_bias
        attention += 2 * self.head_dim * self.qk_layernorm  # q_norm, k_norm
        if self.mla is not None:
            attention = self.mla.num_parameters(h, self.num_heads, bias=bias)
        attention += self.num_heads * self.attention_sinks
        matrices = 3 if is_gated(self.activation) else 2

        def mlp(width: int, with_bias: bool) -> int:
            return matrices * width * h + (with_bias * ((matrices - 1) * width + h))

        def layer(index: int) -> int:
            if self.is_moe_layer(index):
                moe = self.moe
                experts = moe.top_k if active else moe.num_experts
                return (moe.num_experts * (h + moe.router_bias) + experts * mlp(self.moe_ffn_size, moe.add_bias_linear)
                        + (mlp(moe.shared_expert_size, False) if moe.shared_expert_size else 0)
                        + h * moe.shared_expert_gate + norms_per_layer * norm + attention)
            return mlp(ffn, bias) + norms_per_layer * norm + attention

        layers = sum(layer(index) for index in range(self.num_layers))
        if self.mtp is not None:  # per depth: enorm, hnorm, norm, eh_proj and a layer like the last one
            layers += self.mtp.num_layers * (3 * norm + 2 * h * h + layer(self.mtp_layer_index))
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        positions = self.max_seq_length * h if self.position_embedding_type == "learned_absolute" else 0
        return embeddings + positions + layers + norm


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
    # GPT-3 175B (Brown et al. 2020, table 2.1) as Narayanan et al. 2021 ran it: sequence 2048, vocabulary 51,200.
    "gpt3-175b": GPTConfig(vocab_size=51200, max_seq_length=2048, hidden_size=12288, num_heads=96, num_layers=96,
                           dropout=0.1, attention_dropout=0.1),
}

# Llama-shaped decoders: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases (MoE ones below).
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", activation="swiglu", add_bias_linear=False)
DEEPSEEK_V3_MLA = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                            v_head_dim=128)
DEEPSEEK_V3_YARN = RopeScaling(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                               beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
LLAMA_3_1_ROPE = dict(rotary_base=500000.0, rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                                     original_max_position_embeddings=8192))


def _gemma3(*, vocab: int, context: int, hidden: int, layers: int, heads: int, groups: int, ffn: int, head_dim: int,
            scalar: int, window: int, rope_scaling: Optional[RopeScaling]) -> GPTConfig:
    """A published Gemma 3 text model: four (1 + w) RMSNorms a layer, GeGLU, q/k norms, embeddings scaled by
    sqrt(hidden), scores by ``query_pre_attn_scalar ** -0.5`` (``scalar``), every sixth layer full and the others
    sliding over ``window`` keys with their own rotary base (10,000; full layers: 1,000,000, ``rope_scaling``), tied
    embeddings, no soft-capping (Gemma 3 replaced Gemma 2's with the q/k norms)."""
    return GPTConfig(vocab_size=vocab, max_seq_length=context, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_query_groups=groups, ffn_hidden_size=ffn, kv_channels=head_dim, qk_layernorm=True,
                     normalization="ZeroCenteredRMSNorm", position_embedding_type="rope", activation="geglu",
                     add_bias_linear=False, norm_position="sandwich", layer_norm_eps=1e-6, tie_embeddings=True,
                     embedding_multiplier=hidden ** 0.5, softmax_scale=None if scalar == head_dim else scalar ** -0.5,
                     rotary_base=1000000.0, rope_scaling=rope_scaling, rotary_base_local=10000.0, sliding_window=window,
                     layer_types=tuple("full_attention" if (index + 1) % 6 == 0 else "sliding_attention"
                                       for index in range(layers)))


GPT_PRESETS.update({
    # For tests and the default examples: the byte vocabulary, 2 key/value groups (so tp=4 replicates them).
    "llama-tiny": GPTConfig(hidden_size=64, num_layers=4, num_heads=4, num_query_groups=2, ffn_hidden_size=176,
                            tie_embeddings=False, **LLAMA),
    # Sizes from the published Hugging Face configs (config.json of each model).
    "llama-3.2-1b": GPTConfig(vocab_size=128256, max_seq_length=131072, hidden_size=2048, num_layers=16, num_heads=32,
                              num_query_groups=8, ffn_hidden_size=8192,
                              **{**LLAMA_3_1_ROPE, "rope_scaling": RopeScaling(factor=32.0)}, **LLAMA),
    "llama-3.1-8b": GPTConfig(vocab_size=128256, max_seq_length=131072, hidden_size=4096, num_layers=32, num_heads=32,
                              num_query_groups=8, ffn_hidden_size=14336, tie_embeddings=False, **LLAMA_3_1_ROPE, **LLAMA),
    "llama-3.1-70b": GPTConfig(vocab_size=128256, max_seq_length=131072, hidden_size=8192, num_layers=80, num_heads=64,
                               num_query_groups=8, ffn_hidden_size=28672, tie_embeddings=False, **LLAMA_3_1_ROPE, **LLAMA),
    # Mistral-7B-v0.3 (no sliding window; v0.1's was sliding_window=4096).
    "mistral-7b": GPTConfig(vocab_size=32768, max_seq_length=32768, hidden_size=4096, num_layers=32, num_heads=32,
                            num_query_groups=8, ffn_hidden_size=14336, rotary_base=1000000.0, tie_embeddings=False, **LLAMA),
    "qwen2.5-7b": GPTConfig(vocab_size=152064, max_seq_length=131072, hidden_size=3584, num_layers=28, num_heads=28,
                            num_query_groups=4, ffn_hidden_size=18944, rotary_base=1000000.0, layer_norm_eps=1e-6,
                            add_qkv_bias=True, tie_embeddings=False, **LLAMA),
    # Qwen3 (Qwen/Qwen3-0.6B, -4B, -8B, -14B, -32B config.json on the Hugging Face Hub): Llama's pieces with per-head
    # q/k RMSNorm and 128-channel heads whatever the width; no biases; 0.6B and 4B tie their embeddings.
    **{name: GPTConfig(vocab_size=151936, max_seq_length=40960, hidden_size=h, num_layers=layers, num_heads=heads,
                       num_query_groups=8, ffn_hidden_size=ffn, kv_channels=128, qk_layernorm=True,
                       rotary_base=1000000.0, layer_norm_eps=1e-6, tie_embeddings=tied, **LLAMA)
       for name, (h, layers, heads, ffn, tied) in {"qwen3-0.6b": (1024, 28, 16, 3072, True),
                                                   "qwen3-4b": (2560, 36, 32, 9728, True),
                                                   "qwen3-8b": (4096, 36, 32, 12288, False),
                                                   "qwen3-14b": (5120, 40, 40, 17408, False),
                                                   "qwen3-32b": (5120, 64, 64, 25600, False)}.items()},
    # Gemma 3's text models (google/gemma-3-1b-pt's config.json; the text_config of gemma-3-12b-pt and -27b-pt).
    "gemma-3-1b": _gemma3(vocab=262144, context=32768, hidden=1152, layers=26, heads=4, groups=1, ffn=6912, head_dim=256,
                          scalar=256, window=512, rope_scaling=None),
    "gemma-3-12b": _gemma3(vocab=262208, context=131072, hidden=3840, layers=48, heads=16, groups=8, ffn=15360,
                           head_dim=256, scalar=256, window=1024, rope_scaling=RopeScaling(factor=8.0, rope_type="linear")),
    "gemma-3-27b": _gemma3(vocab=262208, context=131072, hidden=5376, layers=62, heads=32, groups=16, ffn=21504,
                           head_dim=128, scalar=168, window=1024, rope_scaling=RopeScaling(factor=8.0, rope_type="linear")),
    # Mixtures of Experts. For tests and the examples: llama-tiny with 8 experts of which each token uses 2.
    "mixtral-tiny": GPTConfig(hidden_size=64, num_layers=4, num_heads=4, num_query_groups=2, ffn_hidden_size=176,
                              tie_embeddings=False, moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=64,
                                                                  aux_loss_coeff=1e-2), **LLAMA),
    "mixtral-8x7b": GPTConfig(vocab_size=32000, max_seq_length=32768, hidden_size=4096, num_layers=32, num_heads=32,
                              num_query_groups=8, ffn_hidden_size=14336, rotary_base=1000000.0, tie_embeddings=False,
                              moe=MoEConfig(num_experts=8, top_k=2, aux_loss_coeff=0.02), **LLAMA),
    # Qwen1.5-MoE-A2.7B: 60 experts of width 1408, 4 per token (weights not renormalised), one gated shared expert.
    "qwen1.5-moe-a2.7b": GPTConfig(vocab_size=151936, max_seq_length=8192, hidden_size=2048, num_layers=24,
                                   num_heads=16, ffn_hidden_size=5632, rotary_base=1000000.0, layer_norm_eps=1e-6,
                                   add_qkv_bias=True, tie_embeddings=False,
                                   moe=MoEConfig(num_experts=60, top_k=4, ffn_hidden_size=1408, normalize_topk=False,
                                                 aux_loss_coeff=1e-3, shared_expert_size=5632, shared_expert_gate=True),
                                   **LLAMA),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): Qwen3's attention (q/k norms, 128-channel heads, 4 key/value
    # heads), every layer MoE, 128 experts of width 768 of which 8 per token, weights renormalised, no shared expert;
    # 30.5B parameters, 3.3B active (the model card's numbers; embedding and head counted).
    "qwen3-30b-a3b": GPTConfig(vocab_size=151936, max_seq_length=40960, hidden_size=2048, num_layers=48, num_heads=32,
                               num_query_groups=4, ffn_hidden_size=6144, kv_channels=128, qk_layernorm=True,
                               rotary_base=1000000.0, layer_norm_eps=1e-6, tie_embeddings=False,
                               moe=MoEConfig(num_experts=128, top_k=8, ffn_hidden_size=768, normalize_topk=True,
                                             aux_loss_coeff=1e-3), **LLAMA),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): multi-head latent attention, 3 dense layers then 58 MoE
    # layers of 256 sigmoid-routed experts (8 per token among the 4 best of 8 groups, weights x 2.5, the
    # aux-loss-free bias) and one shared expert; the sequence-wise balance loss at the paper's 1e-4. YaRN over
    # 4,096 positions by 40 with DeepSeek's mscale and mscale_all_dim 1: cos/sin unscaled, the softmax scale
    # 192 ** -0.5 times (0.1 ln 40 + 1) ** 2 (MLAConfig.softmax_scale).
    "deepseek-v3": GPTConfig(vocab_size=129280, max_seq_length=163840, hidden_size=7168, num_layers=61, num_heads=128,
                             ffn_hidden_size=18432, layer_norm_eps=1e-6, tie_embeddings=False,
                             mla=DEEPSEEK_V3_MLA, rope_scaling=DEEPSEEK_V3_YARN,
                             softmax_scale=DEEPSEEK_V3_MLA.softmax_scale(DEEPSEEK_V3_YARN),
                             moe=MoEConfig(num_experts=256, top_k=8, ffn_hidden_size=2048, layer_freq=(0,) * 3 + (1,) * 58,
                                           score_function="sigmoid", expert_bias=True, aux_loss_coeff=1e-4,
                                           shared_expert_size=2048, router_num_groups=8, router_group_topk=4,
                                           router_topk_scaling_factor=2.5), **LLAMA),
    # For tests and examples: DeepSeek-V3's pieces at llama-tiny's width, one dense layer then three MoE layers.
    "deepseek-v3-tiny": GPTConfig(hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=96, layer_norm_eps=1e-6,
                                  tie_embeddings=False,
                                  mla=MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                                qk_rope_head_dim=8, v_head_dim=16),
                                  moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=16, layer_freq=(0, 1, 1, 1),
                                                score_function="sigmoid", expert_bias=True, shared_expert_size=16,
                                                router_num_groups=2, router_group_topk=1,
                                                router_topk_scaling_factor=2.5), **LLAMA),
})

# OpenAI's gpt-oss (openai/gpt-oss-20b and -120b config.json): every layer a Mixture of Experts of clamped-SwiGLU experts
# with biases (top-4, a router bias), attention with sinks and biases, 64 heads of 64 channels over 8 key/value
# heads, sliding-window (128) and full layers alternating, YaRN (factor 32 over 4096 positions, theta 150,000).
GPT_OSS = dict(vocab_size=201088, max_seq_length=131072, hidden_size=2880, num_heads=64, num_query_groups=8,
               kv_channels=64, ffn_hidden_size=2880, rotary_base=150000.0, layer_norm_eps=1e-5, tie_embeddings=False,
               rope_scaling=RopeScaling(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                        beta_fast=32.0, beta_slow=1.0, truncate=False),
               add_attention_bias=True, attention_sinks=True, sliding_window=128,
               **{**LLAMA, "activation": "clamped_swiglu"})
GPT_PRESETS.update({
    name: GPTConfig(num_layers=layers, layer_types=("sliding_attention", "full_attention") * (layers // 2),
                    moe=MoEConfig(num_experts=experts, top_k=4, aux_loss_coeff=0.9, router_bias=True,
                                  add_bias_linear=True), **GPT_OSS)
    for name, (layers, experts) in {"gpt-oss-20b": (24, 32), "gpt-oss-120b": (36, 128)}.items()
})


class GPTEmbedding(nn.Module):
    """Token embeddings, plus learned absolute positions when the config asks for them (rotary
    positions are applied inside attention instead). ``multiplier`` (``GPTConfig.embedding_multiplier``) scales
    the token embeddings, rounded to their dtype first as transformers' ``Gemma3TextScaledWordEmbedding`` does."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        learned = config.position_embedding_type == "learned_absolute"
        self.wpe = nn.Embedding(config.max_seq_length, config.hidden_size) if learned else None
        self.drop = nn.Dropout(config.dropout)
        self.multiplier = config.embedding_multiplier

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        x = self.wte(input_ids)
        if self.multiplier is not None:  # fp32 first, then the embedding's dtype: transformers' buffer, cast. A CPU
            # scalar tensor: the device reads it as a kernel argument, with no copy and no wait.
            x = x * torch.tensor(self.multiplier, dtype=torch.float32).to(x.dtype)
        if self.wpe is not None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device) if position_ids is None else position_ids
            x = x + self.wpe(positions)
        return self.drop(x)


def gpt_layer(config: GPTConfig, index: int = 0, aux_losses: Optional[AuxLosses] = None) -> TransformerLayer:
    """Decoder layer ``index`` with the pieces the config names (its MLP a Mixture of Experts where ``moe`` says)."""
    rotary = None
    if config.position_embedding_type == "rope":
        base, scaling = config.rotary_of(index)
        rotary = RotaryEmbedding(config.mla.qk_rope_head_dim if config.mla else config.head_dim, base=base,
                                 scaling=scaling)
    qk_norm = partial(build_norm, config.normalization, config.head_dim, eps=config.layer_norm_eps)
    if config.mla is not None:
        attention = MultiLatentAttention(
            config.hidden_size, config.num_heads, config.mla,
            norm=partial(build_norm, config.normalization, eps=config.layer_norm_eps), rotary=rotary,
            attention_dropout=config.attention_dropout, bias=config.add_bias_linear,
            window=config.attention_window(index), softmax_scale=config.softmax_scale,
            softcap=config.attn_logit_softcapping)
    else:
        attention = SelfAttention(config.hidden_size, config.num_heads, num_query_groups=config.num_query_groups,
                                  head_dim=config.head_dim, attention_dropout=config.attention_dropout, causal=True,
                                  qkv_bias=config.qkv_bias, proj_bias=config.proj_bias, rotary=rotary,
                                  qk_norm=qk_norm if config.qk_layernorm else None,
                                  window=config.attention_window(index), softmax_scale=config.softmax_scale,
                                  softcap=config.attn_logit_softcapping, sinks=config.attention_sinks)
    if config.is_moe_layer(index):
        mlp = MoE(config.hidden_size, config.moe, default_ffn_size=config.ffn_size, activation=config.activation,
                  aux_losses=aux_losses)
    else:
        mlp = build_mlp(config.activation, config.hidden_size, config.ffn_size, bias=config.add_bias_linear)
    return TransformerLayer(attention, mlp, partial(build_norm, config.normalization, config.hidden_size,
                                                    eps=config.layer_norm_eps), dropout=config.dropout,
                            norm_position=config.norm_position)


def gpt_tensor_parallel_plan(config: GPTConfig) -> dict[str, object]:
    """What tensor parallelism may split in a ``GPTModel`` of this config (names relative to the model). The
    chunked loss has nothing to swap: it reads the group and the vocabulary slice from the head."""
    if config.moe is None:
        layers = _layer_tensor_parallel_plan(config, "blocks.*", moe=False)
    else:  # MoE and dense layers have different MLPs: one entry per layer
        layers = {}
        for index in range(config.num_layers):
            layers.update(_layer_tensor_parallel_plan(config, f"blocks.{index}", moe=config.is_moe_layer(index)))
    if config.mtp is not None:
        layers.update(_mtp_tensor_parallel_plan(config))
    return {
        "embedding.wte": "vocab",
        "embedding": "sequence_scatter",
        **layers,
        "ln_f": "sequence_parallel",
        "lm_head": "vocab",
        **({} if config.loss_chunk_tokens else {"loss_fn": "vocab"}),
    }


def _layer_tensor_parallel_plan(config: GPTConfig, prefix: str, *, moe: bool) -> dict[str, object]:
    """One decoder layer's entries under ``prefix``: attention (or latent attention) and a dense MLP or the MoE's."""
    gated = is_gated(config.activation)
    plan = layer_tensor_parallel_plan(prefix, num_heads=config.num_heads, num_query_groups=config.num_query_groups,
                                      gated_mlp=gated, mlp=not moe, qk_norm=config.qk_layernorm,
                                      attention=config.mla is None, sinks=config.attention_sinks)
    if config.mla is not None:
        plan.update(mla_tensor_parallel_plan(prefix, config.mla))
    if moe:
        plan.update(moe_tensor_parallel_plan(f"{prefix}.mlp", config.moe, gated_mlp=gated))
    return plan


def _mtp_tensor_parallel_plan(config: GPTConfig) -> dict[str, object]:
    """The multi-token prediction depths: each layer split as a decoder layer; the norms and ``eh_proj`` replicated,
    run on sequence chunks under sequence parallelism (their gradients summed over tp). The embedding is the model's
    own module, split as ``embedding.wte``, its output scattered along the sequence as the model's input is."""
    plan: dict[str, object] = {}
    moe = config.is_moe_layer(config.mtp_layer_index)
    for k in range(config.mtp.num_layers):
        prefix = f"mtp.depths.{k}"
        plan.update(_layer_tensor_parallel_plan(config, f"{prefix}.layer", moe=moe))
        plan.update({f"{prefix}.{name}": "sequence_parallel" for name in ("enorm", "hnorm", "eh_proj", "norm")})
    return plan


class GPTModel(nn.Module):
    """Token ids ``[B, S]`` -> logits ``[B, S, V]`` (``V/tp`` under tensor parallelism)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        with uninitialised_build():  # initialize_parameters (below, or the strategy's) sets every parameter
            self.embedding = GPTEmbedding(config)
            # The MoE layers' load-balancing and z-losses (shared by all of them; see models/moe.py).
            self.moe_aux_losses = AuxLosses()
            # A dict keyed "0", "1", ... (not a list): a pipeline stage keeps only its layers, and their
            # parameter names (blocks.7.mlp.fc.weight) stay global.
            self.blocks = nn.ModuleDict({str(index): gpt_layer(config, index, self.moe_aux_losses)
                                         for index in range(config.num_layers)})
            self.ln_f = build_norm(config.normalization, config.hidden_size, eps=config.layer_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embedding.wte.weight
        self.mtp_statistics: Optional[tuple[Tensor, Tensor]] = None  # see pipeline_result
        self.mtp = None if config.mtp is None else MultiTokenPrediction(
            config.mtp, config.hidden_size, self.embedding,
            make_layer=lambda _: gpt_layer(config, config.mtp_layer_index, self.moe_aux_losses),
            make_norm=partial(build_norm, config.normalization, config.hidden_size, eps=config.layer_norm_eps))
        if config.loss_chunk_tokens:
            self.loss_fn = ChunkedHeadLoss(chunk_tokens=config.loss_chunk_tokens, ignore_index=IGNORE_INDEX,
                                           softcap=config.final_logit_softcapping)
        else:
            self.loss_fn = nn.CrossEntropyLoss(reduction="sum", ignore_index=IGNORE_INDEX)
        if not self.embedding.wte.weight.is_meta:
            initialize_parameters(self, seed=torch.initial_seed())

    def initialize_parameter(self, name: str, tensor: Tensor, generator: torch.Generator) -> None:
        """GPT-2 init; output projections of residual branches scaled by 1/sqrt(2 * layers) (Radford et al. 2019)."""
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            tensor.normal_(0.0, INIT_STD / math.sqrt(2 * self.config.num_layers), generator=generator)
        elif name.endswith("attn.sinks"):  # no pull of a sink at first
            tensor.zero_()
        else:
            default_initializer(name, tensor, generator)

    def tensor_parallel_plan(self) -> dict[str, object]:
        return gpt_tensor_parallel_plan(self.config)

    def fused_projections(self) -> dict[str, tuple[str, ...]]:
        """Layers fusing projections that the original architecture keeps apart (``peft.lora`` adapts each):
        ``qkv`` of rotary models (Llama's ``q_proj``/``k_proj``/``v_proj``; GPT-2-shaped models, with learned
        positions, have one ``c_attn``), a SwiGLU MLP's ``fc`` (``gate_proj``/``up_proj``)."""
        return layer_fused_projections("blocks.*", separate_qkv=self.config.position_embedding_type == "rope"
                                       and self.config.mla is None,
                                       gated_mlp=is_gated(self.config.activation))

    @staticmethod
    def recompute_plan() -> dict[str, str]:
        return layer_recompute_plan("blocks.*")

    @staticmethod
    def pipeline_blocks() -> PipelineBlocks:
        return PipelineBlocks(first=("embedding",), layers="blocks", last=("ln_f", "lm_head", "loss_fn", "mtp"))

    # The pipeline protocol (pipeline/blocks.py); forward and loss are built from it. The side inputs are the
    # per-document masks of packed samples (data/gpt_dataset.py): ``position_ids`` [B, S] that restart at every
    # document, and ``document_ids`` [B, S], which confine attention to the token's own document.
    def embed(self, input_ids: Tensor, *, position_ids: Optional[Tensor] = None, **side: Tensor) -> Tensor:
        if input_ids.shape[1] > self.config.max_seq_length:
            raise ValueError(
                f"Sequence length {input_ids.shape[1]} exceeds max_seq_length={self.config.max_seq_length} of the model."
            )
        return self.embedding(input_ids, position_ids)

    def layer_kwargs(self, *, position_ids: Optional[Tensor] = None, document_ids: Optional[Tensor] = None,
                     kv_cache=None, **side) -> dict:
        kwargs = {}
        if document_ids is not None:  # O(S): no [S, S] mask (context_parallel/documents.py)
            kwargs["attention_mask"] = DocumentMask(document_ids)
        if position_ids is not None and self.config.position_embedding_type == "rope":
            kwargs["positions"] = position_ids
        if kv_cache is not None:
            kwargs["kv_cache"] = kv_cache
        return kwargs

    def head(self, x: Tensor, *, logits_to_keep: int = 0, **side) -> Tensor:
        """Logits of every position, or of the last ``logits_to_keep`` (generation needs only the last); soft-capped
        where the config says (``final_logit_softcapping``)."""
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return self._logits(self.ln_f(x))

    def _logits(self, normed: Tensor) -> Tensor:
        return soft_cap(self.lm_head(normed), self.config.final_logit_softcapping)

    def loss_head(self, x: Tensor, *, mtp_tokens: Optional[Tensor] = None, **side) -> Tensor:
        """What the last stage hands to :meth:`pipeline_loss`: the logits, or under ``loss_chunk_tokens`` the final
        norm's output (the chunked loss applies the head itself). With multi-token prediction (``mtp_tokens``, from
        :meth:`pipeline_batch`) the depths' follow the main one's along a new dim 1: ``[B, 1 + D, S, ...]``."""
        chunked = self.config.loss_chunk_tokens
        if mtp_tokens is None:
            return self.ln_f(x) if chunked else self.head(x, **side)
        normed = self.ln_f(x)  # what the head reads is what the first depth reads (Megatron-Core's decoder output)
        depths = self.mtp(normed, mtp_tokens, position_ids=side.get("position_ids"),
                          layer_kwargs=self.layer_kwargs(**side))
        return torch.stack([normed, *depths] if chunked else list(map(self._logits, [normed, *depths])), dim=1)

    def pipeline_batch(self, input_ids: Tensor, labels: Tensor, *, position_ids: Optional[Tensor] = None,
                       document_ids: Optional[Tensor] = None) -> PipelineBatch:
        """With multi-token prediction the target is ``[B, 1 + D, S]`` (the labels, then each depth's,
        ``shifted_labels``) and the last stage also reads the shifted input tokens (``mtp_tokens``, ``[B, D, S]``)."""
        num_tokens = (labels != IGNORE_INDEX).sum()
        side = _present(position_ids=position_ids, document_ids=document_ids)
        if self.config.mtp is None or not self.training:  # evaluation reports the main loss alone
            return PipelineBatch(inputs=(input_ids,), target=labels, num_tokens=num_tokens, side=side)
        depths = self.config.mtp.num_layers
        target = torch.cat([labels[:, None], shifted_labels(labels, depths, document_ids)], dim=1)
        return PipelineBatch(inputs=(input_ids,), target=target, num_tokens=num_tokens,
                             side={**side, "mtp_tokens": shifted_tokens(input_ids, depths)})

    def pipeline_loss(self, outputs: Tensor, labels: Tensor) -> tuple[Tensor, dict]:
        """The main loss's sum; with multi-token prediction (a ``[B, 1 + D, S]`` target) the depths' sums join it in
        the gradient only, scaled by ``loss_scaling_factor / D``, and come back as ``extras`` (per depth: the sum of
        token losses and the tokens counted)."""
        if labels.dim() == 2:
            return self._token_loss_sum(outputs, labels), {}
        main = self._token_loss_sum(outputs[:, 0].contiguous(), labels[:, 0].contiguous())
        depth_sums = torch.stack([self._token_loss_sum(outputs[:, k].contiguous(), labels[:, k].contiguous())
                                  for k in range(1, labels.shape[1])])
        scale = self.config.mtp.loss_scaling_factor / self.config.mtp.num_layers
        mtp = scale * depth_sums.sum()
        counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=(0, 2))
        return main + (mtp - mtp.detach()), {"mtp_loss_sum": depth_sums.detach().float(), "mtp_tokens": counts}

    def _token_loss_sum(self, outputs: Tensor, labels: Tensor) -> Tensor:
        if self.config.loss_chunk_tokens:
            return self.loss_fn(outputs, labels, self.lm_head)
        return self.loss_fn(outputs.flatten(0, 1), labels.flatten())

    def pipeline_result(self, loss_sum: Tensor, num_tokens: Tensor, extras: dict) -> tuple[Tensor, Tensor]:
        """``(loss_sum, num_tokens)``; the multi-token prediction's sums and counts of this batch (every rank's:
        the pipeline runner broadcasts them from the last stage) are kept as ``mtp_statistics`` for logging."""
        if "mtp_loss_sum" in extras:
            self.mtp_statistics = (extras["mtp_loss_sum"], extras["mtp_tokens"])
        return loss_sum, num_tokens

    @staticmethod
    def shape_inference() -> ContextManager[None]:
        """The pipeline stages' shape-inference pass is not a training step: it counts no expert loads."""
        return routing_uncounted()

    def forward(self, input_ids: Tensor, *, position_ids: Optional[Tensor] = None,
                document_ids: Optional[Tensor] = None, kv_cache=None, logits_to_keep: int = 0,
                for_loss: bool = False, mtp_tokens: Optional[Tensor] = None) -> Tensor:
        """``kv_cache`` and ``logits_to_keep``: generation's (``lightning_megatron.generation``); ``for_loss``: return
        what :meth:`pipeline_loss` takes (:meth:`loss_head`), for :meth:`loss`, which runs through ``__call__`` so
        that ZeRO-3's hooks gather the parameters."""
        side = _present(position_ids=position_ids, document_ids=document_ids, kv_cache=kv_cache,
                        logits_to_keep=logits_to_keep or None)
        self.moe_aux_losses.drain()  # what an earlier forward left (loss() takes them; see models/moe.py)
        x = self.embed(input_ids, **side)
        layer_kwargs = self.layer_kwargs(**side)
        for block in self.blocks.values():
            x = block(x, **layer_kwargs)
        return self.loss_head(x, mtp_tokens=mtp_tokens, **side) if for_loss else self.head(x, **side)

    def loss(self, input_ids: Tensor, labels: Tensor, **side: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """``(sum of token losses, number of counted tokens)``; labels of ``-100`` are ignored. ``side``: the
        optional ``position_ids`` and ``document_ids`` of packed samples."""
        batch = self.pipeline_batch(input_ids, labels, **side)
        loss_sum, extras = self.pipeline_loss(self(input_ids, **batch.side, for_loss=True), batch.target)
        aux = self.moe_aux_losses.drain()
        if aux is not None:  # in the gradient, not in the value: the loss reported stays the language model's
            loss_sum = loss_sum + (aux - aux.detach())
        return self.pipeline_result(loss_sum, batch.num_tokens, extras)


#: GPTConfig fields that say how a model trains, not what it computes: a run may set them over a pretrained model's.
TRAINING_FIELDS = ("dropout", "attention_dropout", "loss_chunk_tokens")


def _check_same_model(config: GPTConfig, base: GPTConfig, pretrained: str) -> None:
    given, found = asdict(config), asdict(base)
    differ = [f"{name}={given[name]!r} (the directory's: {found[name]!r})" for name in given
              if name not in TRAINING_FIELDS and given[name] != found[name]]
    if differ:
        raise ValueError(f"The config given with pretrained={pretrained!r} describes another model than the one "
                         f"there: {', '.join(differ)}. Leave config=None to take the directory's config.json.")


def _pretrained_over_preset(preset: str, base: GPTConfig, pretrained: str) -> GPTConfig:
    """The config of the ``pretrained`` directory, which a preset name gives way to (see ``GPT``); one line on rank
    zero when the preset described another model."""
    given, found = asdict(GPTConfig.from_name(preset)), asdict(base)
    differ = [name for name in given if name not in TRAINING_FIELDS and given[name] != found[name]]
    if differ:
        rank_zero_info(f"pretrained={pretrained!r} gives the model's config (its config.json), in place of the preset "
                       f"config={preset!r}, which differs in {', '.join(differ)}.")
    return base


def _present(**side: Optional[Tensor]) -> dict[str, Tensor]:
    return {name: value for name, value in side.items() if value is not None}


#: The keys of a GPT batch, besides ``input_ids`` and ``labels``, that the model takes (data/gpt_dataset.py).
SIDE_INPUTS = ("position_ids", "document_ids")


def side_inputs(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The batch's ``SIDE_INPUTS`` that it has (packed samples carry both; plain ones neither)."""
    return {name: batch[name] for name in SIDE_INPUTS if name in batch}


class GPT(BatchFlops, PretrainingRecipe):
    """A GPT LightningModule to train as is or to subclass.

    Example::

        model = GPT(GPTConfig.from_name("gpt-tiny"))
        trainer = L.Trainer(strategy=Megatron3DStrategy(tensor_parallel_size=2), devices=2)

    ``training_step`` returns ``{"loss", "num_tokens"}``: the strategy uses ``num_tokens`` to
    make the loss a per-token mean over the whole global batch, across micro-batches and
    data-parallel ranks.

    ``lora``: a :class:`~lightning_megatron.peft.lora.LoRAConfig` (or its fields as a dict, a YAML ``lora:``
    block): the model trains low-rank adapters of the targeted linear layers and nothing else::

        model = GPT(pretrained="hf_dir", lora={"rank": 8, "alpha": 16}, learning_rate=2e-4)

    ``lora`` may also be a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, made by
    ``peft``'s ``save_pretrained`` for ``pretrained``'s model, or by ``checkpoint convert --peft``): its settings
    give the ``LoRAConfig`` and the adapters start from its tensors (``huggingface.adapters.read_peft_adapter``,
    which refuses by name what this LoRA does not compute), so training continues it at any layout. The
    hyper-parameters record the ``LoRAConfig`` it gave: a checkpoint of the run rebuilds the module without it.

    ``pretrained``: a Hugging Face ``save_pretrained`` directory (Llama, Mistral, Qwen2, GPT-2, ...) whose weights
    the run starts from. Its ``config.json`` gives the config when ``config`` is None (neither given:
    ``"gpt-tiny"``) or a preset name: ``pretrained`` takes precedence over a preset (a config file's
    ``config: llama-tiny`` and ``--model.init_args.pretrained DIR`` train DIR's model, said in one line when the
    shapes differ), which is used only where the directory is not there (a config file names its base and still
    plans, ``lightning-megatron plan``, where the weights are not). A config given as a ``GPTConfig`` or a dict
    must describe the same model (only ``dropout``, ``attention_dropout`` and ``loss_chunk_tokens``, which are how
    it trains, may differ), else a ``ValueError`` names the fields when the weights are read, in
    ``configure_model``. Its cost: under ``Megatron3DStrategy`` every rank reads the full
    weights into host memory once (and the model is built there in full, with random values first), then the
    strategy keeps this rank's shards of them and the rest is freed; one process needs the whole model in
    memory anyway. The path is saved in the hyper-parameters, so ``load_from_checkpoint`` and a resumed run rebuild
    the same module; a LoRA run's checkpoints then store the adapters only, with a reference to this base
    (``checkpoint.base``).
    """

    def __init__(
        self,
        config: Union[GPTConfig, str, dict, None] = None,
        *,
        learning_rate: float = 1e-3,
        min_learning_rate: float = 1e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        warmup_steps: int = 20,
        adam_implementation: str = "auto",
        lora: Optional[Union[LoRAConfig, dict, str, os.PathLike]] = None,
        pretrained: Optional[str] = None,
    ) -> None:
        super().__init__()
        pretrained = None if pretrained is None else os.fspath(pretrained)
        if config is None:  # the directory's config.json (no weights read here), else the default preset
            config = "gpt-tiny" if pretrained is None else self.hf_format().read_config(pretrained)
        elif isinstance(config, str) and pretrained is not None and os.path.isdir(pretrained):
            config = _pretrained_over_preset(config, self.hf_format().read_config(pretrained), pretrained)
        self.init_recipe(GPTConfig, config, learning_rate=learning_rate, min_learning_rate=min_learning_rate,
                         weight_decay=weight_decay, betas=betas, adam_eps=adam_eps, warmup_steps=warmup_steps,
                         adam_implementation=adam_implementation)
        self.pretrained = pretrained
        self.lora_start: Optional[dict[str, Tensor]] = None  # the adapters of a PEFT directory, our names
        if isinstance(lora, (str, os.PathLike)):
            if pretrained is None:
                raise ValueError(f"lora={os.fspath(lora)!r} is a PEFT adapter directory, which adapts a base model: "
                                 f"give pretrained=<the Hugging Face directory of that base> too.")
            lora, self.lora_start = self.hf_format().read_peft_adapter(os.fspath(lora), self.config, base=pretrained)
        self.lora = LoRAConfig.of(lora)
        self.save_hyperparameters({"lora": None if self.lora is None else self.lora.as_dict(),
                                   "pretrained": pretrained})
        self.model: Optional[GPTModel] = None
        self.val_loss = MeanMetric()

    def configure_model(self) -> None:
        """Build the model (on the meta device under ``Megatron3DStrategy``; with ``pretrained``'s weights in host
        memory), with ``lora``'s adapters attached before any parallelism (``peft.lora``): only they train then.
        Under the strategy the adapters of a pretrained model are left on the meta device, so that the strategy
        gives them their layout-invariant start from its seed, as it does without ``pretrained``; adapters read from
        a PEFT directory stay real, and the strategy keeps each rank's shards of them as of the base weights."""
        if self.model is not None:
            return
        on_meta = torch.empty(()).is_meta  # inside the strategy's model_sharded_context
        start, self.lora_start = self.lora_start, None  # a PEFT directory's adapters: copied in once, then let go
        if self.pretrained is None:
            model = GPTModel(self.config)
            if self.lora is not None:
                apply_lora(model, self.lora)
        else:
            with torch.device("cpu"):
                model = GPTModel(self.config)
                base_config, state_dict = self.hf_format().read(self.pretrained)
                _check_same_model(self.config, base_config, self.pretrained)
                load_base_weights(model, state_dict, what=f"The Hugging Face weights in {self.pretrained}")
                if self.lora is not None:
                    apply_lora(model, self.lora)
                if start is not None:  # names and shapes checked when read
                    with torch.no_grad():
                        for name, param in model.named_parameters():
                            if is_adapter_name(name):
                                param.copy_(start[name])
            if on_meta and self.lora is not None and start is None:
                for name in adapted_layers(model):  # the layer's own weights stay real: only its adapters move
                    for adapter in ADAPTER_MODULES:
                        getattr(model.get_submodule(name), adapter).to("meta")
        if not on_meta and self.lora is not None and self.lora.quantize_base is not None:
            quantize_in_place(model)  # one process; under the strategy its preparation quantises (peft.nf4)
        self.model = model

    @classmethod
    def from_hf(cls, model_or_dir: Union[str, os.PathLike, nn.Module], **kwargs):
        """A module holding the weights of a Hugging Face model: a ``save_pretrained`` directory is
        ``GPT(pretrained=model_or_dir, **kwargs)`` built at once (``configure_model``); a ``transformers`` model is
        converted in memory (its module then records no ``pretrained`` path)."""
        if isinstance(model_or_dir, (str, os.PathLike)):
            module = cls(pretrained=model_or_dir, **kwargs)
            module.configure_model()
            return module
        return super().from_hf(model_or_dir, **kwargs)

    @staticmethod
    def hf_format() -> HFFormat:
        """``from_hf``/``to_hf`` convert to and from ``transformers``' ``GPT2LMHeadModel``, ``LlamaForCausalLM``,
        ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MixtralForCausalLM``,
        ``Qwen2MoeForCausalLM`` and ``GptOssForCausalLM`` (reading: by ``model_type``; writing: by the config)."""
        return hf_format_for(GPTConfig)

    def to_hf(self, out_dir, *, state_dict: Optional[Mapping[str, Tensor]] = None, **kwargs) -> None:
        """``PretrainingRecipe.to_hf``; a model with multi-token prediction is written without its depths (one
        warning says so): what transformers loads of DeepSeek-V3 too (it drops ``model.layers.61.*``), and what
        inference and fine-tuning need. Refusing would leave such a run no export at all."""
        if self.config.mtp is None:
            return super().to_hf(out_dir, state_dict=state_dict, **kwargs)
        state = self.state_dict() if state_dict is None else state_dict
        rank_zero_warn(f"to_hf: the multi-token prediction depths (GPTConfig.mtp, {self.config.mtp.num_layers} "
                       f"layer(s)) are left out of {os.fspath(out_dir)!r}: transformers' models have no place for them.")
        kept = {name: value for name, value in state.items() if not name.startswith("model.mtp.")}
        config, self.config = self.config, replace(self.config, mtp=None)
        try:
            super().to_hf(out_dir, state_dict=kept, **kwargs)
        finally:
            self.config = config

    def tensor_parallel_plan(self) -> dict[str, object]:
        return {f"model.{pattern}": style for pattern, style in gpt_tensor_parallel_plan(self.config).items()}

    @staticmethod
    def recompute_plan() -> dict[str, str]:
        return {f"model.{pattern}": mode for pattern, mode in GPTModel.recompute_plan().items()}

    def pipeline_blocks(self) -> PipelineBlocks:
        return GPTModel.pipeline_blocks().under("model")

    def validate_parallel_config(self, parallel_config) -> None:
        self.config.validate_tensor_parallel_size(parallel_config.tensor_parallel_size)
        self.config.validate_expert_layout(parallel_config.tensor_parallel_size, parallel_config.expert_parallel_size)
        if parallel_config.context_parallel_size > 1 and self.config.mtp is not None:
            raise ValueError(
                f"context_parallel_size={parallel_config.context_parallel_size} with multi-token prediction "
                f"(GPTConfig.mtp) is not supported: each depth reads the tokens k positions ahead, which cross the "
                f"ranks' sequence chunks. Use context_parallel_size=1 or GPTConfig.mtp=None.")
        if parallel_config.context_parallel_size > 1 and self.config.moe is not None:
            raise ValueError(
                f"context_parallel_size={parallel_config.context_parallel_size} with a Mixture-of-Experts model is not "
                f"supported: its load-balancing loss and capacity are per sequence, and each sequence would be split "
                f"over ranks. Use context_parallel_size=1 (expert_parallel_size for the experts).")
        PipelineLayout(
            num_layers=self.config.num_layers,
            pipeline_parallel_size=parallel_config.pipeline_parallel_size,
            virtual_pipeline_size=parallel_config.virtual_pipeline_size,
            layers_per_stage=parallel_config.pipeline_layers_per_stage,
        )

    def validate_pipeline_schedule(self, schedule: str) -> None:
        """Multi-token prediction runs under 1F1B, GPipe and interleaved 1F1B; the zero-bubble schedules' split
        backward with the depths on the last stage is not built (their runs did not finish), so it is refused."""
        if self.config.mtp is not None and SCHEDULE_SPECS[schedule].split_backward:
            raise ValueError(f"pipeline_schedule={schedule!r} with multi-token prediction (GPTConfig.mtp) is not "
                             f"supported: its split backward does not run the depths on the last stage. Use "
                             f"'1f1b', 'gpipe' or 'interleaved_1f1b', or GPTConfig.mtp=None.")

    def sequence_inputs(self) -> SequenceInputs:
        """How context parallelism cuts a batch: tokens, labels and positions by position (learned and rotary
        positions both read ``position_ids``); the document ids of packed samples whole, in the ring's order,
        since every rank's attention reads the documents of every rank's keys."""
        return SequenceInputs(split=("input_ids", "labels", "position_ids"), key_masks=("document_ids",),
                              max_length=self.config.max_seq_length)

    def forward(self, input_ids: Tensor, **side: Tensor) -> Tensor:
        return self.model(input_ids, **side)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        loss_sum, num_tokens = self.model.loss(batch["input_ids"], batch["labels"], **side_inputs(batch))
        loss = loss_sum / num_tokens.clamp(min=1)
        self.log("train_loss", self.global_token_mean(loss_sum, num_tokens), prog_bar=True)
        if self.config.mtp is not None:  # every depth's token losses per counted token (the gradient's scale aside)
            depth_sums, depth_tokens = self.model.mtp_statistics
            self.log("mtp_loss", self.global_token_mean(depth_sums.sum(), depth_tokens.sum()))
        if self.config.moe is not None:
            statistics = self.model.moe_aux_losses.statistics()  # every rank: it sums over the model-parallel ranks
            self.log("moe_load_balancing", statistics[0], sync_dist=True)
            self.log("moe_z_loss", statistics[1], sync_dist=True)
            self.log("moe_max_load", statistics[2], sync_dist=True)
        return {"loss": loss, "num_tokens": num_tokens}

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        moe = self.config.moe
        if moe is not None and moe.expert_bias:  # DeepSeek-V3's aux-loss-free balancing, from the global batch's loads
            update_expert_biases(self.model, moe.expert_bias_update_rate,
                                 reduce=lambda counts: self.trainer.strategy.reduce(counts, reduce_op="sum"))

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss_sum, num_tokens = self.model.loss(batch["input_ids"], batch["labels"], **side_inputs(batch))
        self.val_loss.update(loss_sum / num_tokens.clamp(min=1), weight=num_tokens)

    def on_validation_epoch_end(self) -> None:
        self._log_held_out("val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        self._log_held_out("test")

    def generate(self, input_ids, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, eos_id: Optional[int] = None, seed: int = 0, *,
                 attention_mask: Optional[Tensor] = None, pad_id: Optional[int] = None):
        """Continue the prompts; greedy by default. In one process and under ``Megatron3DStrategy`` at any
        layout, with the same tokens for the same seed (see :func:`lightning_megatron.generation.generate`
        for the arguments and what it returns). Under the strategy every rank must call it (tensor and
        pipeline ranks communicate), e.g. from a callback's hook, which Lightning runs on every rank.

        Example::

            gpt = GPT.from_hf("gpt2_dir")
            gpt.generate(torch.tensor([[464, 2068, 7586]]), max_new_tokens=20)  # prompt + 20 tokens, as HF's
        """
        return generate(self.model, input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, eos_id=eos_id, seed=seed, attention_mask=attention_mask, pad_id=pad_id)

    def predict_step(self, batch: dict, batch_idx: int = 0) -> dict:
        """A batch of prompts (with ``attention_mask``, as ``data.prompts.PromptDataset`` gives): ``{"tokens": one
        list per prompt, its tokens and the generated ones}`` with the batch's ``generation`` settings. A batch of
        samples (``input_ids``, e.g. ``GPTDataModule``'s): ``{"logits": [B, S, vocab_size]}`` in fp32 over the whole,
        unpadded vocabulary. Both on every rank, at every layout."""
        if "attention_mask" in batch:
            mask = batch["attention_mask"].bool()
            prompts = [row[keep].tolist() for row, keep in zip(batch["input_ids"], mask)]
            return {"tokens": self.generate(prompts, **batch.get("generation", {}))}
        return {"logits": full_logits(self.model, batch["input_ids"], **side_inputs(batch))}

    def _log_held_out(self, split: str) -> None:
        """Per-token loss and perplexity over the whole split (the metric syncs over dp)."""
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log(f"{split}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{split}_perplexity", loss.exp(), sync_dist=True)

