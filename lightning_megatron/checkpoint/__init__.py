"""Checkpoints that do not depend on the parallel layout: sharded directories and full state dicts (Hugging Face
conversion: ``lightning_megatron.huggingface``)."""

from lightning_megatron.checkpoint import reader as _reader  # noqa: F401 (registers load_from_checkpoint's reader)
from lightning_megatron.checkpoint.full import gather_full_state_dict, local_state_dict_from_full, merge_pipeline_stages
from lightning_megatron.checkpoint.sharded import consolidated_state_dict, open_sharded, read_full_tensors

__all__ = [
    "consolidated_state_dict",
    "gather_full_state_dict",
    "local_state_dict_from_full",
    "merge_pipeline_stages",
    "open_sharded",
    "read_full_tensors",
]
