"""What a model tells the strategy about splitting it into pipeline stages.

``pipeline_blocks()`` names the submodules that only the first stage keeps (the
embedding), the ``nn.ModuleDict`` of layers that is split over stages, and the submodules
that only the last stage keeps (final norm, heads, loss). The root model (``root``) then
provides the pipeline protocol, which its own ``forward``/``loss`` are built from, so the
two paths cannot drift apart:

* ``pipeline_batch(*args, **kwargs) -> PipelineBatch``: the arguments of ``loss()`` split
  into first-stage inputs, per-sample side inputs every stage sees (masks), the target,
  and the number of tokens the loss counts;
* ``embed(*inputs, **side)`` (first stage), ``layer_kwargs(**side)`` (keyword arguments of
  every layer), ``head(hidden, **side)`` (last stage: the logits, for generation and prediction), and
  optionally ``loss_head(hidden, **side)`` (last stage, for the loss: what ``pipeline_loss`` takes; by default
  ``head``'s output);
* ``pipeline_loss(outputs, target) -> (loss_sum, extras)``: the summed loss of a
  micro-batch and metrics to sum over micro-batches (e.g. correct predictions);
* ``pipeline_result(loss_sum, num_tokens, extras)``: what ``loss()`` returns;
* optionally ``shape_inference()``: a context manager the stages' shape-inference pass (torch runs each
  stage once more on stand-in inputs, ``pipeline/runner.py``) runs in, for state that pass must leave alone
  (an MoE model's expert loads and routing statistics: ``models.router.routing_uncounted``).

Under pipeline parallelism the strategy replaces the root's ``loss`` with one that runs
this protocol through the pipeline schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import Tensor, nn


@dataclass(frozen=True)
class PipelineBlocks:
    """Submodule names, relative to ``root`` (the module that implements the protocol)."""

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    root: str = ""

    def root_of(self, module: nn.Module) -> nn.Module:
        """The submodule of ``module`` (the model that declared these blocks) that implements the protocol."""
        return module.get_submodule(self.root) if self.root else module

    def under(self, prefix: str) -> "PipelineBlocks":
        """The same blocks, seen from a parent module that holds the model as ``prefix``."""
        return replace(self, root=f"{prefix}.{self.root}" if self.root else prefix)


@dataclass
class PipelineBatch:
    inputs: tuple[Tensor, ...]
    target: Tensor
    num_tokens: Tensor
    side: dict[str, Tensor] = field(default_factory=dict)
