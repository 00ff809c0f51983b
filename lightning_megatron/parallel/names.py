"""Matching parameter and module names: the one spelling every layer of the package uses.

Plans (tensor-parallel, recompute, compile, ZeRO-3's wrapping) name modules by dotted patterns in which ``*``
stands for one component (``blocks.*.attn.qkv``), and adapters are recognised by the names of the child modules
they attach (``...qkv.lora_a.weight``). Both sit here, at the bottom, so that initialisation, FP8, checkpoints
and the optimizer can ask about a name without importing the parts that define what the names mean.
"""

from __future__ import annotations

#: The child modules an adapted layer gets (``peft.lora``); a parameter under one of them is an adapter parameter.
ADAPTER_MODULES = ("lora_a", "lora_b")


def name_matches(pattern: str, name: str) -> bool:
    """``*`` matches exactly one component of a dotted module name."""
    pattern_parts, name_parts = pattern.split("."), name.split(".")
    return len(pattern_parts) == len(name_parts) and all(p in ("*", n) for p, n in zip(pattern_parts, name_parts))


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or module name lies inside an adapter (``...qkv.lora_a.weight``)."""
    return any(part in ADAPTER_MODULES for part in name.split("."))
