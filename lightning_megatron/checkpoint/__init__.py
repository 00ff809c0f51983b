"""Checkpoints that do not depend on the parallel layout."""

from lightning_megatron.checkpoint.full import gather_full_state_dict, local_state_dict_from_full, merge_pipeline_stages

__all__ = ["gather_full_state_dict", "local_state_dict_from_full", "merge_pipeline_stages"]
