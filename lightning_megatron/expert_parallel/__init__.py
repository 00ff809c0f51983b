"""Expert parallelism: each rank of an expert-parallel group holds ``1/ep`` of every MoE layer's experts.

``dispatcher.py`` moves tokens to their experts' ranks and back with two all-to-alls; ``apply.py``
keeps a rank's own experts, tags their parameters (reduced over the expert-data-parallel group)
and wires the MoE layers' auxiliary losses to the layout.
"""

from lightning_megatron.expert_parallel.apply import apply_expert_parallel, wire_auxiliary_losses
from lightning_megatron.expert_parallel.dispatcher import AllToAllDispatcher, all_to_all

__all__ = ["AllToAllDispatcher", "all_to_all", "apply_expert_parallel", "wire_auxiliary_losses"]
