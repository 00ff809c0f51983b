"""Building a ``transformers`` model with its parameters on the meta device, and reading a ``save_pretrained``
directory's tensors one rank's part at a time (the initialiser of those parameters)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor, nn

from lightning_megatron.parallel.shards import TensorShard


class SafetensorsWeights:
    """The tensors of a ``save_pretrained`` directory (``model.safetensors`` or sharded with an index), read one at
    a time by name, a rank's part of each only (``read_local``): the initialiser of a model's parameters."""

    def __init__(self, directory: Union[str, os.PathLike]) -> None:
        self.directory = Path(directory)
        single, index = self.directory / "model.safetensors", self.directory / "model.safetensors.index.json"
        if single.is_file():
            from safetensors import safe_open
            with safe_open(str(single), framework="pt") as weights:
                self.files = dict.fromkeys(weights.keys(), single.name)
        elif index.is_file():
            self.files = json.loads(index.read_text())["weight_map"]
        else:
            raise FileNotFoundError(f"{self.directory} holds no safetensors weights (model.safetensors or "
                                    f"model.safetensors.index.json, as save_pretrained writes them).")

    def read_local(self, name: str, shard: Optional[TensorShard], global_shape: tuple[int, ...]) -> Tensor:
        """This rank's part of tensor ``name`` (``shard``: its tensor-parallel split; None: the whole), in fp32 with
        zero padding, as ``parallel.initialize.local_initial_values`` returns it; reads only the part's rows (or
        columns) of the file."""
        with self._open(name) as weights:
            part = weights.get_slice(name)
            if tuple(part.get_shape()) != tuple(global_shape):
                raise ValueError(f"{self.directory}: {name} has shape {tuple(part.get_shape())}, the model built "
                                 f"from its config {tuple(global_shape)}.")
            if shard is None:
                return part[:].to(torch.float32)
            local = torch.zeros(shard.local_shape, dtype=torch.float32)
            for segment in shard.segments():
                rows = [slice(None)] * len(global_shape)
                rows[shard.dim] = slice(segment.start, segment.start + segment.size)
                local.narrow(shard.dim, segment.local_start, segment.size).copy_(part[tuple(rows)])
            return local

    def __call__(self, name: str, tensor: Tensor, generator: torch.Generator) -> None:
        """As an initialiser (``initialize_parameter``) of the whole tensor: ``read_local`` serves every caller."""
        tensor.copy_(self.read_local(name, None, tuple(tensor.shape)))

    def _open(self, name: str):
        if name not in self.files:
            raise KeyError(f"{self.directory} has no tensor {name!r} (it has e.g. {sorted(self.files)[:4]}).")
        from safetensors import safe_open
        return safe_open(str(self.directory / self.files[name]), framework="pt")


class ParametersOnMeta:
    """Inside: modules register their parameters on the meta device (buffers stay where they are made: the rotary
    frequencies are computed, not loaded). Records each 1-D parameter's constructor value where it is one constant
    (a norm's gain: ones, or zeros for Gemma's ``1 + w``), the start transformers gives it."""

    def __enter__(self):
        self.fills: dict[int, float] = {}
        self.original = nn.Module.register_parameter
        fills, original = self.fills, self.original

        def register(module, name, param):
            if param is not None and not param.is_meta:
                value = param.detach()
                meta = nn.Parameter(value.to("meta"), requires_grad=param.requires_grad)
                if value.dim() == 1 and value.numel() and bool((value == value[0]).all()):
                    fills[id(meta)] = float(value[0])
                param = meta
            original(module, name, param)

        nn.Module.register_parameter = register
        return self

    def __exit__(self, *exc_info) -> None:
        nn.Module.register_parameter = self.original
