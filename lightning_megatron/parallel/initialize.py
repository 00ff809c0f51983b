"""Layout-invariant parameter initialisation.

A parameter's initial value depends only on the seed and its global name
(``blocks.7.mlp.fc.weight``), never on tp/pp/dp: each rank builds the full parameter
from a generator seeded by the name, then keeps its own shard. Modules may define
``initialize_parameter(name, tensor, generator)`` to choose the distribution of their
parameters (names are then relative to that module); others get
:func:`default_initializer`. Adapter parameters (``...lora_a.weight``) always follow the adapter's rule
(``peft.adapters``).

Params on the meta device are materialised on ``device``; real params are overwritten in
place, so a single-process model and every parallel layout start identical.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from lightning_megatron.peft.adapters import initialize_adapter, is_adapter_name
from lightning_megatron.tensor_parallel.sharding import shard_of

Initializer = Callable[[str, Tensor, torch.Generator], None]
INIT_STD = 0.02
# Python attributes our code puts on parameters; whatever replaces a parameter must carry them over.
PARAMETER_TAGS = ("tensor_shard", "sequence_parallel_grad", "pipeline_tied", "pipeline_stage_uses", "tied_names",
                  "expert_parallel")


def parameter_seed(seed: int, name: str) -> int:
    """A stable seed per (run seed, global name): crc32 is identical on every machine and Python run."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63 - 1)


def default_initializer(name: str, tensor: Tensor, generator: torch.Generator) -> None:
    """GPT-2's scheme: weights ~ N(0, 0.02); biases zero; other vectors (norm gains) one."""
    if tensor.dim() >= 2:
        tensor.normal_(0.0, INIT_STD, generator=generator)
    elif name.endswith("bias"):
        tensor.zero_()
    else:
        tensor.fill_(1.0)


def _is_within(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def initializer_owners(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost submodules (the root included) that define their own ``initialize_parameter``."""
    owners: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if hasattr(module, "initialize_parameter") and not any(_is_within(name, o) for o, _ in owners):
            owners.append((name, module))
    return owners


def original_name(param: Tensor, name: str) -> str:
    """A tied copy on another pipeline stage (the last stage's head) is the parameter it copies: initialised
    as it, saved under its name."""
    tied = getattr(param, "tied_names", None)
    if tied is not None and name.endswith(tied[0]):
        return name[: len(name) - len(tied[0])] + tied[1]
    return name


def local_initial_values(param: Tensor, name: str, seed: int, initializer: Initializer) -> Tensor:
    """This rank's shard of the full initial value of parameter ``name``; an adapter's by the adapter's rule, whichever
    module owns it (``B = 0``: the adapted model starts as the base model), here for every caller (ZeRO-3's too)."""
    shard = shard_of(param)
    global_shape = shard.global_shape if shard is not None else tuple(param.shape)
    full = torch.empty(global_shape, dtype=torch.float32)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    (initialize_adapter if is_adapter_name(name) else initializer)(name, full, generator)
    return full if shard is None else shard.local_slice(full)


def initialize_buffers(root: nn.Module, device: Optional[torch.device | str], *, only_meta: bool = True) -> None:
    """Modules that define ``initialize_buffers()`` (e.g. a router's expert bias, a persistent state that starts at
    zero) get their own buffers allocated on ``device`` and filled by it: those still on the meta device, or all of
    them with ``only_meta=False`` (after ``to_empty``, which leaves them uninitialised)."""
    for module in root.modules():
        fill = getattr(module, "initialize_buffers", None)
        own = list(module.buffers(recurse=False))
        if fill is None or not own or (only_meta and not any(b.is_meta for b in own)):
            continue
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:  # its own buffers only (to_empty would also empty the parameters)
                module._buffers[name] = torch.empty_like(buffer, device=device)
        with torch.no_grad():
            fill()


def initialize_parameters(
    root: nn.Module, seed: int, device: Optional[torch.device | str] = None, *, only_meta: bool = False
) -> None:
    """Give every parameter of ``root`` its layout-invariant initial value (see the module docstring).

    ``only_meta=True`` materialises meta parameters and leaves real ones (e.g. loaded weights) alone.
    """
    done: dict[int, nn.Parameter] = {}
    plans: list[tuple[str, nn.Module, Initializer]] = [
        (prefix, owner, owner.initialize_parameter) for prefix, owner in initializer_owners(root)
    ]
    plans.append(("", root, default_initializer))
    for prefix, owner, initializer in plans:
        for module_name, module in owner.named_modules(remove_duplicate=False):
            for param_name, param in list(module.named_parameters(recurse=False)):
                if id(param) in done:
                    setattr(module, param_name, done[id(param)])
                    continue
                if only_meta and not param.is_meta:
                    done[id(param)] = param
                    continue
                name = f"{module_name}.{param_name}" if module_name else param_name
                name = original_name(param, name)
                values = local_initial_values(param, name, seed, initializer)
                target_device = device if device is not None else (None if param.is_meta else param.device)
                if param.is_meta:
                    new = nn.Parameter(values.to(device=target_device, dtype=param.dtype), requires_grad=param.requires_grad)
                    for tag in PARAMETER_TAGS:
                        if hasattr(param, tag):
                            setattr(new, tag, getattr(param, tag))
                    setattr(module, param_name, new)
                else:
                    with torch.no_grad():
                        param.copy_(values)
                    new = param
                done[id(param)] = new
                done[id(new)] = new
    initialize_buffers(root, device)
    meta_buffers = [name for name, buffer in root.named_buffers() if buffer.is_meta]
    if meta_buffers:
        raise RuntimeError(
            f"Buffers {meta_buffers} are still on the meta device after initialisation. Create buffers outside the "
            f"meta context (for example in forward) or register them with persistent=False and fill them in setup."
        )
