"""A transformer layer assembled from swappable pieces, and what may be split of it.

The pieces live in modules of their own: ``attention.py`` (multi-head / grouped-query
self-attention with a fused ``qkv``), ``mlp.py`` (GELU, SwiGLU), ``norms.py`` (LayerNorm,
RMSNorm), ``rotary.py`` (rotary positions). No process groups in sight: under tensor
parallelism the strategy swaps ``qkv``/``fc`` for column-parallel and ``proj`` for
row-parallel layers, as :func:`layer_tensor_parallel_plan` declares.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from torch import Tensor, nn

from lightning_megatron.models.attention import CoreAttention, SelfAttention
from lightning_megatron.models.mlp import MLP, GatedMLP
from lightning_megatron.tensor_parallel.styles import PackedColumn, QueryGroupColumn

__all__ = ["NORM_POSITIONS", "CoreAttention", "GatedMLP", "MLP", "SelfAttention", "TransformerLayer", "TransformerSizes",
           "check_tensor_parallel_split", "dense_mlp_tensor_parallel_plan", "layer_recompute_plan",
           "layer_tensor_parallel_plan"]


#: Where a ``TransformerLayer`` normalises (see its docstring).
NORM_POSITIONS = ("pre", "post", "sandwich")


class TransformerLayer(nn.Module):
    """Pre-norm layer: ``x + drop(attn(ln_1(x)))`` then ``x + drop(mlp(ln_2(x)))``.

    ``norm_position="post"`` gives the original Transformer/BERT order,
    ``ln(x + drop(attn(x)))`` then ``ln(x + drop(mlp(x)))``; pre-norm is what lets deep
    models train stably (Megatron-LM's BERT finding), post-norm matches Hugging Face BERT.
    ``norm_position="sandwich"`` also normalises each branch's output before the residual add,
    ``x + drop(post_attn_norm(attn(ln_1(x))))`` then ``x + drop(post_mlp_norm(mlp(ln_2(x))))`` (Gemma 2 and 3:
    four norms per layer). ``norm`` builds one normalisation (called once per norm).
    """

    def __init__(self, attn: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module], *, dropout: float,
                 norm_position: str = "pre") -> None:
        super().__init__()
        if norm_position not in NORM_POSITIONS:
            raise ValueError(f"norm_position must be one of {NORM_POSITIONS}, got {norm_position!r}.")
        self.post_norm = norm_position == "post"
        self.ln_1 = norm()
        self.attn = attn
        self.post_attn_norm = norm() if norm_position == "sandwich" else nn.Identity()
        self.ln_2 = norm()
        self.mlp = mlp
        self.post_mlp_norm = norm() if norm_position == "sandwich" else nn.Identity()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None, positions: Optional[Tensor] = None,
                kv_cache=None) -> Tensor:
        """``attention_mask``: booleans broadcast to ``[B, heads, S, S]``, True = attend, or the document ids of
        packed samples (a ``DocumentMask``; ``None``: the attention's own causal or full pattern); ``positions``:
        ``[B, S]`` token positions for rotary attention; ``kv_cache``: the keys and values of earlier tokens when
        generating (see ``SelfAttention.forward``)."""
        if self.post_norm:
            x = self.ln_1(x + self.drop(self.attn(x, attention_mask, positions, kv_cache)))
            return self.ln_2(x + self.drop(self.mlp(x)))
        x = x + self.drop(self.post_attn_norm(self.attn(self.ln_1(x), attention_mask, positions, kv_cache)))
        return x + self.drop(self.post_mlp_norm(self.mlp(self.ln_2(x))))


def layer_tensor_parallel_plan(prefix: str, *, num_heads: int, num_query_groups: Optional[int] = None,
                               gated_mlp: bool = False, mlp: bool = True, qk_norm: bool = False,
                               attention: bool = True, sinks: bool = False) -> dict[str, object]:
    """The plan of every ``TransformerLayer`` under ``prefix`` (e.g. ``"blocks.*"``): Megatron's split, the
    fused ``qkv`` by query group, a gated MLP's ``[gate | up]`` chunk by chunk. ``mlp=False``: the layer's MLP
    is another piece with a plan of its own (an MoE layer: ``models.moe.moe_tensor_parallel_plan``).
    ``qk_norm``: the attention's per-head query and key norms, one gain shared by every head, replicated; each rank
    normalises only its own heads, so their gradients are summed over tp (``"replicated_with_grad_allreduce"``).
    ``attention=False``: the attention is another piece with a plan of its own (multi-head latent attention:
    ``models.latent_attention.mla_tensor_parallel_plan``). ``sinks``: the attention's per-head sink logits
    (GPT-OSS's ``attn.sinks``), split with the query heads (``"per_head"``)."""
    plan = {prefix: "sequence_parallel"}
    if attention:
        plan.update({f"{prefix}.attn": "sharded_dropout",
                     f"{prefix}.attn.qkv": QueryGroupColumn(num_heads, num_query_groups or num_heads),
                     f"{prefix}.attn.proj": "row"})
    if attention and sinks:
        plan[f"{prefix}.attn.sinks"] = "per_head"
    if qk_norm:
        plan.update({f"{prefix}.attn.{norm}": "replicated_with_grad_allreduce" for norm in ("q_norm", "k_norm")})
    if mlp:
        plan.update(dense_mlp_tensor_parallel_plan(f"{prefix}.mlp", gated_mlp=gated_mlp))
    return plan


def layer_fused_projections(prefix: str, *, separate_qkv: bool, gated_mlp: bool) -> dict[str, tuple[str, ...]]:
    """The layers under ``prefix`` that fuse projections the original architecture has as separate modules, and
    those projections in the fused layer's order: ``qkv`` when the original has ``q``, ``k`` and ``v`` apart
    (Llama's ``q_proj``...; not GPT-2, whose ``c_attn`` is one module), a gated MLP's ``fc`` (``gate``, ``up``).
    What a LoRA adapter per projection reads (``peft.lora``); where each part lies in the fused output is the
    layer's tensor-parallel style's (``tensor_parallel.styles``)."""
    return {**({f"{prefix}.attn.qkv": ("q", "k", "v")} if separate_qkv else {}),
            **({f"{prefix}.mlp.fc": ("gate", "up")} if gated_mlp else {})}


def layer_recompute_plan(prefix: str) -> dict[str, str]:
    """What ``activation_checkpointing="selective"`` recomputes in the layers under ``prefix``: attention's core,
    whose saved activations grow with the square of the sequence length (``transforms.recompute``)."""
    return {f"{prefix}.attn.core_attention": "selective"}


def dense_mlp_tensor_parallel_plan(prefix: str, *, gated_mlp: bool) -> dict[str, object]:
    """An ``MLP``/``GatedMLP`` at ``prefix``: ``fc`` column-parallel (``[gate | up]`` chunk by chunk), ``proj`` row."""
    return {f"{prefix}.fc": PackedColumn(2) if gated_mlp else "column", f"{prefix}.proj": "row"}


class TransformerSizes:
    """What GPTConfig and BERTConfig share: presets by name, head and tensor-parallel checks.

    Subclasses are frozen dataclasses with ``hidden_size``, ``num_heads`` and ``ffn_hidden_size``
    fields, and name their presets with ``presets()``.
    """

    @classmethod
    def presets(cls) -> dict:
        raise NotImplementedError

    def _check_heads(self) -> None:
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}: "
                f"each head needs hidden_size / num_heads channels."
            )

    @property
    def ffn_size(self) -> int:
        """``ffn_hidden_size``, by default ``4 * hidden_size``."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @classmethod
    def from_name(cls, name: str, **overrides):
        """A preset by name, optionally with some fields changed."""
        presets = cls.presets()
        if name not in presets:
            raise ValueError(f"Unknown {cls.__name__[:-6]} preset {name!r}. Available presets: {', '.join(sorted(presets))}.")
        return replace(presets[name], **overrides)

    def validate_tensor_parallel_size(self, tensor_parallel_size: int) -> None:
        check_tensor_parallel_split(tensor_parallel_size, num_heads=self.num_heads, ffn_size=self.ffn_size,
                                    num_query_groups=getattr(self, "num_query_groups", None))


def check_tensor_parallel_split(tensor_parallel_size: int, *, num_heads: int, ffn_size: int,
                                num_query_groups: Optional[int] = None) -> None:
    """Fail with the numbers and a fix when a transformer cannot be split ``tensor_parallel_size`` ways.

    Key/value heads split when tp divides ``num_query_groups`` and are replicated on ``tp / groups``
    ranks when tp is a multiple of it (each rank then takes an equal share of its group's query heads)."""
    tp = tensor_parallel_size
    groups = num_query_groups or num_heads
    if groups != num_heads and groups % tp and (tp % groups or (num_heads // groups) % (tp // groups)):
        valid = [d for d in range(1, num_heads + 1) if num_heads % d == 0 and ffn_size % d == 0
                 and (groups % d == 0 or (d % groups == 0 and (num_heads // groups) % (d // groups) == 0))]
        raise ValueError(
            f"tensor_parallel_size={tp} can neither split num_query_groups={groups} (it must divide it) nor "
            f"replicate them (a multiple of it that divides the {num_heads // groups} query heads of a group, "
            f"num_heads={num_heads}): every rank must hold whole key/value heads and an equal share of the query "
            f"heads. Use a tensor_parallel_size in {valid}."
        )
    problems = [f"{name}={value}" for name, value in (("num_heads", num_heads), ("ffn_hidden_size", ffn_size)) if value % tp]
    if problems:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0 and ffn_size % d == 0]
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide {' and '.join(problems)}: every rank must hold whole "
            f"attention heads and an equal share of the MLP. Use a tensor_parallel_size in {divisors}."
        )
