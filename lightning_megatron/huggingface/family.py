"""A Hugging Face model family, and the reading and writing every family does the same way.

A family module (``gpt2.py``, ``bert.py``, ``llama.py``, ...) supplies only what differs: the configs
both ways, its rules (``mapping.py``) and how errors name things. ``Family`` turns those into state
dict conversion both ways, ``read`` (a ``transformers`` model or a directory) and ``write`` (a
``save_pretrained`` directory, shard by shard from a ``TensorSource``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Collection, Mapping, Optional, Sequence, Union

from torch import Tensor

from lightning_megatron.huggingface.io import PathOrModel, dtype_name, read_hf_checkpoint, size_in_bytes, write_hf_directory
from lightning_megatron.huggingface.mapping import StateDictMapping


def model_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The model's own state dict from a GPT/BERT LightningModule's (names under ``model.``, the rest dropped);
    a state dict with no ``model.`` names is returned as is."""
    if not any(name.startswith("model.") for name in state_dict):
        return dict(state_dict)
    return {name.removeprefix("model."): value for name, value in state_dict.items() if name.startswith("model.")}


@dataclass(frozen=True)
class TensorSource:
    """Our model's full tensors by name, read a few at a time: what an export converts.

    ``specs``: name -> a tensor with the right shape and dtype (meta tensors will do, e.g. from a
    checkpoint's index); ``read(names)``: those tensors, whole. A state dict in memory is a source
    (``TensorSource.of``); so is a sharded checkpoint (``checkpoint convert`` reads it that way), so an
    export never needs the whole model in one process.
    """

    specs: Mapping[str, Tensor]
    read: Callable[[Sequence[str]], Mapping[str, Tensor]]

    @classmethod
    def of(cls, state_dict: Mapping[str, Tensor]) -> "TensorSource":
        """A state dict in memory (a LightningModule's, with ``model.`` names, is accepted too)."""
        state = model_state_dict(state_dict)
        return cls(state, lambda names: {name: state[name] for name in names})


@dataclass(frozen=True)
class Family:
    """What one Hugging Face family supplies: its ``model_type``, our config, model and LightningModule classes,
    and functions:

    * ``config_from_hf(fields, weight_names)``: our config from ``config.json``'s fields (the weight names
      tell optional heads apart, e.g. BERT's next-sentence head);
    * ``hf_config(config, **extra_fields)``: ``config.json``'s fields, refusing what the family cannot hold;
    * ``mapping(config)``: the ``StateDictMapping`` of that config's model;
    * ``hf_name(name)``: a Hugging Face name as the rules spell it (older checkpoints' spellings), or
      ``None`` for what is not a weight (buffers).
    """

    model_type: str
    config_class: type
    lightning_module: type
    config_from_hf: Callable[[Mapping[str, Any], Collection[str]], Any]
    hf_config: Callable[..., dict[str, Any]]
    mapping: Callable[[Any], StateDictMapping]
    hf_name: Callable[[str], Optional[str]]
    expected: str  # what read() accepts, for its TypeError: "a transformers GPT2LMHeadModel"

    def _renamed(self, hf_state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        renamed = {}
        for name, value in hf_state_dict.items():
            name = self.hf_name(name)
            if name is not None:
                renamed[name] = value
        return renamed

    def state_dict_from_hf(self, hf_state_dict: Mapping[str, Tensor], config: Any) -> dict[str, Tensor]:
        """Our model's full state dict (global names) from a full Hugging Face one."""
        return self.mapping(config).to_ours(self._renamed(hf_state_dict))

    def hf_state_dict(self, state_dict: Mapping[str, Tensor], config: Any) -> dict[str, Tensor]:
        """The Hugging Face state dict (tied entries included) of our full state dict, spelled as checkpoints
        store it (one tensor per expert; see ``canonical_hf_state_dict``). Under tensor or pipeline
        parallelism, convert the gathered state dict, not a rank's own."""
        return self.mapping(config).to_hf(state_dict)

    def canonical_hf_state_dict(self, hf_state_dict: Mapping[str, Tensor], config: Any) -> dict[str, Tensor]:
        """A Hugging Face state dict (a model's or a checkpoint's) spelled as ``hf_state_dict`` returns it: older
        names renamed, buffers dropped, experts that ``transformers`` 5 stacks in memory split one per expert (as
        ``save_pretrained`` writes them). What to compare a conversion back with."""
        return self.mapping(config).unstacked(self._renamed(hf_state_dict))

    def read(self, model_or_dir: PathOrModel) -> tuple[Any, dict[str, Tensor]]:
        """Our config and full state dict from a ``transformers`` model or a ``save_pretrained`` directory."""
        fields, hf_state = read_hf_checkpoint(model_or_dir, expected=self.expected)
        config = self.config_from_hf(fields, hf_state.keys())
        return config, self.state_dict_from_hf(hf_state, config)

    def write(self, out_dir: Union[str, os.PathLike], config: Any, source: TensorSource, *,
              max_shard_size: Union[int, str], **extra_fields: Any) -> None:
        """Write a ``save_pretrained`` directory from ``source``, at most ``max_shard_size`` per weight file.

        The config, names and shapes are checked before anything is written; each shard's tensors are read
        only when it is written (a tie is checked with its original's shard: the embedding's, the first)."""
        mapping = self.mapping(config)
        mapping.check_ours({name: tuple(spec.shape) for name, spec in source.specs.items()})
        fields = self.hf_config(config, **{"dtype": dtype_name(mapping.dtype(source.specs)), **extra_fields})
        shards = mapping.plan_shards(source.specs, size_in_bytes(max_shard_size))
        write_hf_directory(out_dir, fields=fields, shards=[partial(mapping.hf_tensors, shard, source.read)
                                                             for shard in shards])
