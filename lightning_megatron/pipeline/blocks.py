"""What a model tells the strategy about splitting it into pipeline stages.

A pipelined model is a sequence: the ``first`` modules (the embedding) take the batch's
inputs, each layer of ``layers`` takes the previous output, the ``last`` modules (final
norm, output head) produce the logits, and ``loss`` turns logits and labels into a summed
loss. The model's ``loss(*inputs, labels)`` method returns ``(loss_sum, num_tokens)``; under
pipeline parallelism the strategy routes it through the pipeline schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PipelineBlocks:
    """Submodule names, relative to ``root`` (the module that owns ``loss()``)."""

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    loss: str
    root: str = ""

    def under(self, prefix: str) -> "PipelineBlocks":
        """The same blocks, seen from a parent module that holds the model as ``prefix``."""
        return replace(self, root=f"{prefix}.{self.root}" if self.root else prefix)
