"""The feed-forward half of a transformer layer: GELU (GPT-2, BERT), SwiGLU (Llama and its kin), GeGLU (Gemma) or
GPT-OSS's clamped SwiGLU."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = ("gelu", "swiglu", "geglu", "clamped_swiglu")
#: GPT-OSS's clamped SwiGLU: the gate's sigmoid gain and the clamp (transformers' ``swiglu_alpha``, ``swiglu_limit``).
CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT = 1.702, 7.0


def clamped_swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """GPT-OSS's gated unit: ``(up + 1) * gate * sigmoid(alpha * gate)`` with the gate clamped from above and up on
    both sides at ``limit`` (large activations bounded; the ``+ 1`` lets the unit pass the gate through at up = 0)."""
    gate = gate.clamp(max=CLAMPED_SWIGLU_LIMIT)
    up = up.clamp(-CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * CLAMPED_SWIGLU_ALPHA))


def _gated(gate_fn):
    return lambda gate, up: gate_fn(gate) * up


#: The gated MLPs (``GatedMLP``, ``fc`` = ``[gate | up]``) by config name, and how they join gate and up.
GATES = {"swiglu": _gated(F.silu), "geglu": _gated(partial(F.gelu, approximate="tanh")),
         "clamped_swiglu": clamped_swiglu}


def is_gated(activation: str) -> bool:
    """Whether the MLP of ``activation`` is a :class:`GatedMLP` (three matrices, ``fc`` fused ``[gate | up]``)."""
    return activation in GATES


class MLP(nn.Module):
    """``proj(gelu(fc(x)))``; ``gelu_approximate`` is torch's: ``"tanh"`` (GPT-2) or ``"none"`` (exact erf, BERT)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, gelu_approximate: str = "tanh", bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        self.proj = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)
        self.gelu_approximate = gelu_approximate

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.activate(self.fc(x)))

    def activate(self, h: Tensor) -> Tensor:
        """Between ``fc`` and ``proj`` (also what an MoE layer's grouped GEMMs apply, ``models.experts``)."""
        return F.gelu(h, approximate=self.gelu_approximate)


class GatedMLP(nn.Module):
    """A gated linear unit (Shazeer 2020): ``proj(gate_fn(gate(x)) * up(x))``, with gate and up fused in one ``fc``.

    ``activation``: the config's name, which says the gate's function: ``"swiglu"`` (SiLU: Llama) or ``"geglu"``
    (the tanh GELU: Gemma's ``gelu_pytorch_tanh``), or ``"clamped_swiglu"`` (GPT-OSS's: :func:`clamped_swiglu`).
    ``fc``'s output is ``[gate | up]``; under tensor parallelism the
    ``PackedColumn(2)`` style gives each rank the same share of both halves, laid out ``[gate_r | up_r]``, so the
    local ``chunk(2)`` pairs each gate channel with its own up channel at every layout.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, bias: bool = False, activation: str = "swiglu") -> None:
        super().__init__()
        if activation not in GATES:
            raise ValueError(f"activation={activation!r} is not one of the gated {tuple(GATES)}.")
        self.fc = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=bias)
        self.proj = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.activate(self.fc(x)))

    def activate(self, h: Tensor) -> Tensor:
        """``fc``'s ``[gate | up]`` -> ``gate_fn(gate) * up`` (also what an MoE layer's grouped GEMMs apply)."""
        gate, up = h.chunk(2, dim=-1)
        return GATES[self.activation](gate, up)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


def build_mlp(activation: str, hidden_size: int, ffn_hidden_size: int, *, bias: bool) -> nn.Module:
    """An MLP by its config name: ``"gelu"`` (tanh approximation, GPT-2), or a gated one (``GATES``)."""
    if activation == "gelu":
        return MLP(hidden_size, ffn_hidden_size, bias=bias)
    if is_gated(activation):
        return GatedMLP(hidden_size, ffn_hidden_size, bias=bias, activation=activation)
    raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}.")
