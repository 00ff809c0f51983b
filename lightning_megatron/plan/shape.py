"""The sizes of a transformer that the activation and step-time predictions read, from its config.

The planner predicts for this package's transformers (``models.GPT``, ``models.BERT`` and their subclasses:
any LightningModule whose ``config`` is a ``GPTConfig`` or ``BERTConfig``). A module with another config
has shapes the formulas do not know, and is refused with that reason. Multi-head latent attention (``mla``) is
described by its ``MLAConfig``: ``qk_head_dim`` and ``v_head_dim`` are then its heads' widths, ``head_dim`` the
config's (unused by it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_megatron.models.flops import sliding_layers


@dataclass(frozen=True)
class ModelShape:
    config: Any
    causal: bool  # GPT: each query sees the keys before it (flash attention does half the work)
    hidden_size: int
    num_layers: int
    num_heads: int
    query_groups: int
    head_dim: int
    ffn_size: int
    gated_mlp: bool  # SwiGLU: gate and up, then their product
    vocab_size: int
    rms_norm: bool
    rotary: bool
    dropout: float
    attention_dropout: float
    num_experts: int = 0
    top_k: int = 0
    expert_ffn_size: int = 0
    shared_expert_size: int = 0
    moe_layers: int = 0
    head_transform: bool = False  # BERT's masked-LM dense layer + norm before the logits
    qk_norm: bool = False  # an RMSNorm over every query and key head (Qwen3's q_norm/k_norm)
    norms_per_layer: int = 2  # 4 with sandwich norms (Gemma's: after attention and after the MLP too)
    zero_centered_norms: bool = False  # Gemma's (1 + w) RMSNorm: its normalised input kept in fp32
    logit_softcap: bool = False  # final-logit soft-capping: the unchunked head keeps the tanh's output
    sliding_window: Optional[int] = None  # the window of the sliding layers
    sliding_layers: int = 0  # layers that attend within sliding_window keys (GPTConfig.layer_types)
    softcap: bool = False  # soft-capped scores: attention computed densely, its [s, s] probabilities kept
    mla: Any = None  # multi-head latent attention's MLAConfig (DeepSeek-V3's), None: grouped-query attention
    shared_expert_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert (a 2 h GEMM per token)
    sigmoid_router: bool = False  # sigmoid scores, normalised for the balance loss (DeepSeek-V3's)
    router_groups: int = 0  # group-limited routing: the experts' groups and the groups kept per token
    router_group_topk: int = 0

    @classmethod
    def of(cls, module: Any) -> "ModelShape":
        from lightning_megatron.models.bert import BERTConfig
        from lightning_megatron.models.gpt import GPTConfig

        config = getattr(module, "config", None)
        if isinstance(config, GPTConfig):
            from lightning_megatron.models.mlp import is_gated

            moe = config.moe
            return cls(config, True, config.hidden_size, config.num_layers, config.num_heads, config.query_groups,
                       config.head_dim, config.ffn_size, is_gated(config.activation), config.vocab_size,
                       config.normalization in ("RMSNorm", "ZeroCenteredRMSNorm"),
                       config.position_embedding_type == "rope", config.dropout,
                       config.attention_dropout,
                       num_experts=moe.num_experts if moe else 0, top_k=moe.top_k if moe else 0,
                       expert_ffn_size=config.moe_ffn_size if moe else 0,
                       shared_expert_size=moe.shared_expert_size if moe else 0,
                       moe_layers=len(moe.moe_layers(config.num_layers)) if moe else 0,
                       qk_norm=config.qk_layernorm, norms_per_layer=4 if config.norm_position == "sandwich" else 2,
                       zero_centered_norms=config.normalization == "ZeroCenteredRMSNorm",
                       logit_softcap=config.final_logit_softcapping is not None,
                       sliding_window=config.sliding_window, sliding_layers=sliding_layers(config),
                       softcap=config.attn_logit_softcapping is not None, mla=config.mla,
                       shared_expert_gate=bool(moe and moe.shared_expert_gate),
                       sigmoid_router=bool(moe and moe.score_function == "sigmoid"),
                       router_groups=(moe.router_num_groups or 0) if moe else 0,
                       router_group_topk=(moe.router_group_topk or 0) if moe else 0)
        if isinstance(config, BERTConfig):
            return cls(config, False, config.hidden_size, config.num_layers, config.num_heads, config.num_heads,
                       config.hidden_size // config.num_heads, config.ffn_size, False, config.vocab_size, False, False,
                       config.dropout, config.attention_dropout, head_transform=True)
        raise TypeError(f"The layout planner predicts memory and time for lightning_megatron's GPT and BERT (a module "
                        f"whose config is a GPTConfig or BERTConfig); {type(module).__name__}.config is "
                        f"{type(config).__name__}. Subclass GPT or BERT, or plan with one of their configs of the same "
                        f"sizes.")

    @property
    def qk_head_dim(self) -> int:
        """Channels of a query or key head: ``head_dim``, or MLA's ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.mla.qk_head_dim if self.mla is not None else self.head_dim

    @property
    def v_head_dim(self) -> int:
        """Channels of a value head (MLA's ``v_head_dim``; else ``head_dim``)."""
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    @property
    def attention_width(self) -> int:
        """Channels per head the attention kernel runs on: MLA pads the narrower of query/key and value heads to
        the wider (``models.latent_attention``)."""
        return max(self.qk_head_dim, self.v_head_dim)

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers
