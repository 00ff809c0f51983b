"""Model FLOPs of a training step: the count behind TFLOP/s per device and MFU.

*Model* FLOPs, the definition of MFU in PaLM (Chowdhery et al. 2022): the matrix multiplies the
model needs, forward and backward, whatever the implementation does besides (activation
recomputation, padded vocabulary rows, pipeline bubbles are not counted).

One formula for every model here, per token and per layer: Narayanan et al. 2021 ("Efficient
Large-Scale Language Model Training on GPU Clusters"; its ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``
counts the recomputed forward, without which it is the ``72 ...`` below), generalised to grouped-query
attention and gated MLPs. A matrix multiply ``[m, k] @ [k, n]`` costs ``2 m n k``; per token, with
``h = hidden_size``, ``a = num_heads``, ``g = num_query_groups`` (key/value heads), ``d = head_dim``,
``f = ffn_hidden_size``, sequence ``s`` and vocabulary ``V``:

===========================  ====================================
query, key, value            ``2 h (a + 2 g) d``
attention scores ``Q K^T``   ``2 s a d``
attention over values        ``2 s a d``
output projection            ``2 a d h``
MLP                          ``2 h f`` per matrix: 2 (GELU), 3 (SwiGLU: gate, up, down)
MoE MLP (instead)            router ``2 h E``, the ``top_k`` chosen experts' MLPs, the shared expert's MLP
                             and its gate ``2 h`` where present (dropless: every token visits ``top_k``)
logits (once, after layers)  ``2 h V``
===========================  ====================================

Multi-head latent attention (``GPTConfig.mla``) replaces the first four rows: its projections, ``2 h r_q +
2 r_q a (n + r)`` for the queries (``2 h a (n + r)`` without a query latent), ``2 h (r_kv + r) + 2 r_kv a (n + v)``
for the keys and values and ``2 a v h`` out, with ``n``, ``r`` and ``v`` the heads' non-rotary, rotary and value
widths and ``r_q``, ``r_kv`` the latents'; ``2 s a (n + r)`` for the scores and ``2 s a v`` over the values (the zeros
that pad narrower values to the heads' width are not model FLOPs).

The backward pass costs twice the forward (a gradient for the input and one for the weight per
multiply), so a training step is ``3 x`` the forward. The attention terms count the whole ``s x s``
score matrix, as Megatron-LM and PaLM do, also for causal attention. A sliding-window layer (``GPTConfig.
sliding_window``) counts ``min(window, s)`` keys per query in place of ``s``: the whole band, likewise without the
causal discount, so that a long sequence does not count work no kernel does (:func:`attended_keys`). Tied or untied output
layers cost the same (the logits are a multiply either way; an embedding lookup is not one).

For GPT-2-shaped models (``a d = h``, ``g = a``, ``f = 4 h``, GELU) a layer is
``24 h^2 + 4 s h`` per token, and a batch of ``B`` sequences
``3 B s (l (24 h^2 + 4 s h) + 2 h V) = 72 B s l h^2 (1 + s / 6h + V / 12 l h)``: Megatron-LM's formula.
BERT adds its masked-LM transform (a ``h x h`` dense layer on every token) and, with the
sentence-order head, the pooler and the classifier on the [CLS] token of each sequence; it is
bidirectional, so the full score matrix is exactly what it computes.

Example::

    >>> from lightning_megatron.models.gpt import GPTConfig
    >>> config = GPTConfig.from_name("gpt2-124m")
    >>> round(gpt_flops_per_batch(config, batch_size=8, seq_length=1024) / 1e12, 2)   # TFLOPs per step
    7.0
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Optional, Union

from lightning_megatron.models.mlp import is_gated

__all__ = ["bert_flops_per_batch", "flops_per_batch", "forward_flops_per_token", "gpt_flops_per_batch",
           "latent_attention_flops", "megatron_flops_per_batch", "mlp_forward_flops", "moe_forward_flops"]

#: Forward + backward: the backward pass does two multiplies (input and weight gradient) per forward one.
FORWARD_AND_BACKWARD = 3


def attended_keys(seq_length: int, window: Optional[int] = None, *, causal_half: bool = False) -> float:
    """Keys per query of attention over ``seq_length`` tokens with a sliding ``window`` (None: none). The model FLOPs'
    count (``causal_half=False``): ``s``, or ``min(window, s)``. What a causal kernel computes (``causal_half``):
    ``s / 2``, or ``w (1 - w / 2s)`` with ``w = min(window, s)`` (``s / 2`` again when the window covers the
    sequence, ``w`` when the sequence is much longer), the blocks' granularity left out."""
    keys = seq_length if window is None else min(window, seq_length)
    return keys * (1 - keys / (2 * seq_length)) if causal_half else float(keys)


def forward_flops_per_token(*, hidden_size: int, num_layers: int, num_heads: int, seq_length: int, vocab_size: int,
                            ffn_size: int, num_query_groups: Optional[int] = None, head_dim: Optional[int] = None,
                            gated_mlp: bool = False, head_transform: bool = False, sliding_window: Optional[int] = None,
                            sliding_layers: int = 0, latent_attention: Any = None) -> int:
    """Forward FLOPs of one token of a sequence of ``seq_length``: the table in this module's docstring.

    ``num_query_groups``: key/value heads (None: ``num_heads``, multi-head attention); ``head_dim``: None for
    ``hidden_size // num_heads``; ``gated_mlp``: three ``ffn_size`` matrices (SwiGLU) instead of two;
    ``head_transform``: a ``hidden_size x hidden_size`` layer before the logits (BERT's masked-LM head);
    ``sliding_layers`` of the layers attend within ``sliding_window`` keys (:func:`attended_keys`);
    ``latent_attention``: the ``MLAConfig`` of multi-head latent attention (the module docstring's last paragraph).
    """
    h, s = hidden_size, seq_length
    groups = num_query_groups or num_heads
    d = head_dim or hidden_size // num_heads
    qkv = 2 * h * (num_heads + 2 * groups) * d
    per_key = 2 * (2 * num_heads * d)  # scores and values
    keys = (num_layers - sliding_layers) * s + sliding_layers * attended_keys(s, sliding_window)
    projection = 2 * num_heads * d * h
    if latent_attention is not None:
        qkv, per_key, projection = latent_attention_flops(latent_attention, h, num_heads)
    mlp = mlp_forward_flops(h, ffn_size, gated=gated_mlp)
    logits = 2 * h * vocab_size + (2 * h * h if head_transform else 0)
    return int(num_layers * (qkv + projection + mlp) + per_key * keys + logits)


def latent_attention_flops(mla: Any, hidden_size: int, num_heads: int) -> tuple[int, int, int]:
    """Multi-head latent attention's ``(query, key and value projections, FLOPs per attended key, output
    projection)`` for one token (the module docstring's last paragraph)."""
    h, a, qk = hidden_size, num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    queries = 2 * h * a * qk if mla.q_lora_rank is None else 2 * mla.q_lora_rank * (h + a * qk)
    keys_values = 2 * h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + 2 * mla.kv_lora_rank * a * (
        mla.qk_nope_head_dim + mla.v_head_dim)
    return queries + keys_values, 2 * a * (qk + mla.v_head_dim), 2 * a * mla.v_head_dim * h


def mlp_forward_flops(hidden_size: int, ffn_size: int, *, gated: bool) -> int:
    """One token through an MLP of width ``ffn_size``: 2 (GELU) or 3 (SwiGLU) matrices of ``2 h f``."""
    return (3 if gated else 2) * 2 * hidden_size * ffn_size


def moe_forward_flops(config: Any) -> int:
    """One token through an MoE layer of a ``GPTConfig``: the router, ``top_k`` experts, the shared expert and gate."""
    h, moe, gated = config.hidden_size, config.moe, is_gated(config.activation)
    shared = mlp_forward_flops(h, moe.shared_expert_size, gated=gated) + (2 * h if moe.shared_expert_gate else 0)
    return 2 * h * moe.num_experts + moe.top_k * mlp_forward_flops(h, config.moe_ffn_size, gated=gated) + shared


def sliding_layers(config: Any) -> int:
    """How many of a ``GPTConfig``'s layers attend within a sliding window."""
    return sum(config.attention_window(index) is not None for index in range(config.num_layers))


def gpt_flops_per_batch(config: Any, batch_size: int, seq_length: int) -> int:
    """Training FLOPs (forward + backward, no recomputation) of ``batch_size`` sequences of ``seq_length`` tokens
    for a ``GPTConfig``: GPT-2, or Llama-shaped (grouped-query attention, SwiGLU, untied head), dense or MoE. Each
    multi-token prediction depth (``GPTConfig.mtp``) adds its ``eh_proj`` (``2 * 2h * h``), a layer like the last
    one and the logits once more."""
    gated = is_gated(config.activation)
    moe_extra = 0 if config.moe is None else \
        moe_forward_flops(config) - mlp_forward_flops(config.hidden_size, config.ffn_size, gated=gated)

    def forward(num_layers: int, sliding: int, moe_layers: int) -> int:
        return moe_layers * moe_extra + forward_flops_per_token(
            hidden_size=config.hidden_size, num_layers=num_layers, num_heads=config.num_heads,
            num_query_groups=config.num_query_groups, head_dim=config.head_dim, seq_length=seq_length,
            vocab_size=config.vocab_size, ffn_size=config.ffn_size, gated_mlp=gated,
            sliding_window=config.sliding_window, sliding_layers=sliding, latent_attention=getattr(config, "mla", None))

    moe_layers = 0 if config.moe is None else len(config.moe.moe_layers(config.num_layers))
    per_token = forward(config.num_layers, sliding_layers(config), moe_layers)
    mtp = getattr(config, "mtp", None)
    if mtp is not None:
        last = config.mtp_layer_index
        depth = forward(1, int(config.attention_window(last) is not None), int(config.is_moe_layer(last)))
        per_token += mtp.num_layers * (depth + 4 * config.hidden_size ** 2)
    return FORWARD_AND_BACKWARD * batch_size * seq_length * per_token


def bert_flops_per_batch(config: Any, batch_size: int, seq_length: int) -> int:
    """Training FLOPs of ``batch_size`` sequences of ``seq_length`` tokens (padding included: it is computed) for a
    ``BERTConfig``: the encoder, the masked-LM head on every token, and with ``binary_head`` the pooler
    (``h x h``) and the sentence-order classifier (``h x 2``) on each sequence's [CLS] token."""
    h = config.hidden_size
    per_token = forward_flops_per_token(
        hidden_size=h, num_layers=config.num_layers, num_heads=config.num_heads, seq_length=seq_length,
        vocab_size=config.vocab_size, ffn_size=config.ffn_size, head_transform=True)
    per_sequence = (2 * h * h + 2 * h * 2) if config.binary_head else 0
    return FORWARD_AND_BACKWARD * batch_size * (seq_length * per_token + per_sequence)


def flops_per_batch(config: Any, batch_size: int, seq_length: int) -> int:
    """The training FLOPs of a batch for any model config that counts its own (``GPTConfig`` and ``BERTConfig``
    call :func:`gpt_flops_per_batch` / :func:`bert_flops_per_batch`). The configs import this module, never the other
    way round: FLOP counting runs in one direction."""
    count = getattr(config, "flops_per_batch", None)
    if not callable(count):
        raise TypeError(f"No FLOPs formula for {type(config).__name__}: expected a GPTConfig or a BERTConfig. Give the "
                        f"LightningModule a `flops_per_batch(batch_size, seq_length)` method instead.")
    return count(batch_size, seq_length)


def megatron_flops_per_batch(*, batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                             vocab_size: int) -> Union[int, Fraction]:
    """Narayanan et al. 2021 without recomputation: ``72 B s l h^2 (1 + s / 6h + V / 12 l h)``.

    Exact (a ``Fraction`` where it is not a whole number); :func:`gpt_flops_per_batch` equals it for every
    GPT-2-shaped config."""
    b, s, l, h, v = batch_size, seq_length, num_layers, hidden_size, vocab_size
    value = 72 * b * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * l * h))
    return int(value) if value.denominator == 1 else value
