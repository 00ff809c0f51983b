"""ZeRO stage 3 over the data-parallel group, composed with our tensor parallelism (FSDP2 underneath).

"dp" here means the ranks holding the same weight shards: dp x cp under context parallelism
(``ParallelState.replica_mesh``), plain dp otherwise.

Parameters, gradients and optimizer state are all sharded over dp (Rajbhandari et al. 2020):
each transformer layer's parameters are all-gathered just before its forward and freed
after it, gathered again for its backward, and its gradients are reduce-scattered and
freed right after. This is ``torch.distributed.fsdp.fully_shard`` (FSDP2) applied on the
replica (``"dp_cp"``) mesh, one group per layer plus one for the rest (embedding, final norm, head):

* Our tensor-parallel parameters are plain local tensors tagged with ``param.tensor_shard``.
  FSDP2 takes each as if it were a whole tensor and shards it again on dim 0 over dp,
  replacing it by an ``nn.Parameter`` holding a ``DTensor`` on the dp mesh whose global
  shape is the *tp-local* shape. The all-gathered (unsharded) parameter the layers see in
  forward and backward is an ordinary tensor of the tp-local shape, so the tp layers and
  their collectives run unchanged. FSDP2 drops Python attributes of the parameters it
  replaces (checked on torch 2.13); :class:`ZeRO3` puts ``tensor_shard``,
  ``sequence_parallel_grad``, ``pipeline_tied`` and ``tied_names`` back on the sharded
  parameters (the clip and the checkpoint code read them) and re-applies them after
  ``to_empty``.
* Per-token loss. The loss is a *sum* over tokens and gradients are divided by the global
  token count afterwards. FSDP2 averages over dp by default; every FSDP module gets
  ``set_gradient_divide_factor(1.0)`` (not recursive in torch 2.13: it is set on each) and
  ``set_force_sum_reduction_for_comms(True)``: the reduce-scatter is then ``ReduceOp.SUM``
  and FSDP's post-division by 1 is skipped, on NCCL and gloo alike (without forcing sums a
  factor other than dp becomes ``PREMUL_SUM(1/factor)``, which gloo lacks). Both setters
  exist in torch 2.13 (``set_reduce_scatter_divide_factor`` is the deprecated alias).
  :meth:`ZeRO3.finish` then sums the token count over dp and divides the gradient shards.
* Gradient accumulation. ``start_micro_batch(sync=True)`` on every micro-batch
  reduce-scatters each backward and accumulates into the sharded gradient: the ZeRO-3
  memory bound holds throughout (like our ZeRO-2). ``sync=False`` on all but the last
  (``set_requires_gradient_sync(False)``) accumulates the *unsharded* gradients (in
  ``reduce_dtype``) and reduce-scatters once: less communication, but a full tp-local
  gradient per layer lives across micro-batches. Both give the same sums.
* Sequence-parallel replicated parameters (LayerNorm, row-parallel biases) get partial
  gradients on each tp rank. Their dp-sharding is identical on every tp rank (same
  tp-local shape, same dp chunking), so the local shards of the reduce-scattered
  gradients cover the same elements across tp: summing them over tp after FSDP's
  reduce-scatter gives the full sum (tested against the single process). The same holds
  for an embedding tied across the first and last pipeline stage (its two copies have one
  shape), summed over the embedding group, and for the replicated ranges of a segmented tp
  shard (``QueryGroupColumn``'s key/value rows), summed over their tp subgroup: each is a
  flat range of the tp-local tensor, cut to the rows of this rank's dp chunk
  (``optim.partial_grads``, the groups built once in :func:`apply_zero3`).
* Expert parallelism (torchtitan's and Megatron-Core's layout, :func:`shard_experts`): an expert lives on one
  expert-parallel rank and is replicated over its expert-data-parallel group (``ParallelState.expert_data_mesh``),
  so each MoE layer's experts are one FSDP group on that mesh (its router and shared expert get dp groups of their
  own first), nested in the layer's dp group. Every parameter's row chunk, initial value, checkpoint placement
  and full-state-dict slice is that of the mesh sharding it (:func:`shard_coordinates`). Every dp rank still holds
  a distinct piece of every tensor (an expert: one of ``dp / ep`` row chunks on one of ``ep`` ranks), so the norm
  below is unchanged; experts kept whole on each tp rank (``expert_tensor_parallel_size=1``) count on every tp rank.
* Global-norm clipping: squares of the local gradient shards, sharded tp parameters on
  every tp rank (a replicated range of a segmented shard on its primary only), tp-replicated
  ones on tp rank 0 only, a pipeline-tied copy on the first stage only; summed over dp and
  over the model-parallel group (tp x pp).
* Mixed precision. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
  over fp32 parameters: the sharded fp32 parameters *are* Megatron's fp32 main parameters,
  sharded; FSDP casts the shard to bf16 before the all-gather, forward and backward run in
  bf16, gradients are reduced and kept in fp32. Persistent bytes per rank for Adam,
  Psi = tp-local parameter count, N = dp: 4Psi/N (fp32 params) + 4Psi/N (fp32 grads) +
  8Psi/N (two fp32 moments) = 16Psi/N, the ZeRO-3 total (the paper splits the same 16 as
  2 + 2 + 12, keeping bf16 params and grads and an fp32 master copy; here the bf16 copy
  exists only while a layer is gathered). Measured exactly: each rank holds FSDP's dim-0
  chunk of every tensor (``torch.chunk`` sizes: ``ceil(rows / N)`` rows, fewer or none on the
  last ranks), summed over the dp ranks exactly 16Psi, and exactly 16Psi/N per rank when N
  divides every dim 0 (the tests' case). Storage is padded: each parameter shard to
  ``ceil(rows / N)`` rows, the gradients are views of one padded flat buffer per group.
  Transient: the gathered bf16 parameters and the bf16 gradients of the layer in flight,
  and the root group (embedding, final norm, head), which FSDP keeps gathered from forward
  to backward. Without a policy (fp32 training) the persistent bytes are the same 16Psi/N.
* Parameter offload (ZeRO-Offload's parameter tier, ``offload_parameters="cpu"``): FSDP2's ``CPUOffloadPolicy``
  on every group. The padded shards live in host memory (pinned when the mesh is CUDA's: asynchronous copies;
  torch cannot pin without an accelerator); each is copied to the device for its group's all-gather, and the
  reduce-scattered gradient shard is copied back, so the optimizer, which makes its state like the parameters,
  steps in host memory and only the gathered layers occupy the device. :meth:`ZeRO3.initialize` therefore
  materialises the parameters on the CPU (FSDP refuses offloaded shards elsewhere at its first forward) and the
  buffers on the device. Collectives of our own on gradients (the token count, partial-gradient sums, the squared
  norm) run on ``state.device``, NCCL's. Bytes and checkpoints are as without offload: the same shards, in host
  memory. ``"nvme"`` (ZeRO-Infinity) is refused: FSDP2 allocates each step's gradient shards and torch optimizers
  their state in private host memory, so file-backed storage would mean replacing FSDP's internal tensors.
* Full state dict, layout-free: ``checkpoint.full.gather_full_state_dict`` gathers each
  parameter over dp (``DTensor.full_tensor()``, giving the tp-local shard) and then over tp,
  under global names and unpadded global shapes; :func:`load_full_state_dict` cuts this
  rank's tp shard and then its dp chunk back out. Sharded checkpoints write the dp chunks
  as they are (``checkpoint.entries``).

Order in set-up (the strategy): ``parallelize`` -> activation checkpointing -> pipeline
split -> :func:`apply_zero3` (on the meta device is best: nothing is materialised yet) ->
:meth:`ZeRO3.initialize` (materialises only this rank's dp chunk of its tp shard from the
layout-invariant initialiser) -> build the optimizer on the sharded parameters. Modules
already materialised (``initialize_parameters`` first) are sharded as they are. The module
passed is the one whose ``__call__`` runs the forward (GPT: ``GPTModel``, not the
LightningModule), since FSDP's root gathers the remaining parameters in its forward hook.

Evaluation must not run under ``torch.inference_mode()``: FSDP2 creates the unsharded
parameters at the first all-gather and reuses their storage, so a first forward in inference
mode leaves inference tensors that the next training forward may not update ("Inplace update
to inference tensor outside InferenceMode", reproduced on torch 2.13). Lightning uses
``no_grad`` only for its own ``FSDPStrategy`` and on gloo; the strategy should run
validation/test/predict steps under ``torch.inference_mode(False), torch.no_grad()`` (checked).

Pipeline parallelism: the stage modules call ``root.embed`` and ``root.head`` directly, so the
root's forward hook never runs; pass ``other_groups`` (this stage's embedding, final norm, head)
to give each its own group. The stage modules stay plain (torch.distributed.pipelining's
FSDP no-sync path applies only when a stage module is itself an ``FSDPModule``), so every
micro-batch's backward reduce-scatters (ZeRO-3 memory, ``sync=True``). Each micro-batch
all-gathers every layer for its forward and again for its backward;
``reshard_after_forward=False`` saves the second at the cost of keeping a layer gathered from
its first forward of the step to a backward (torchtitan's choice under pp). pp2 x dp2 (1F1B,
2 micro-batches) is tested against the single process, the pipeline-tied embedding copies
summed as local shards; ``reshard_after_forward=False`` gave the same result in a one-off run.

Example::

    parallelize(model, model.tensor_parallel_plan(), state)           # on the meta device
    zero3 = apply_zero3(model, state, layers_pattern="blocks.*")       # offload_parameters="cpu": host memory
    zero3.initialize(seed, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())                 # sharded DTensor params
    for micro_batch in micro_batches:
        zero3.start_micro_batch(sync=True)
        loss_sum, tokens = model.loss(*micro_batch)
        loss_sum.backward()
    zero3.finish(step_tokens)                                         # sum over dp, divide
    zero3.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_megatron.offload.settings import OffloadSettings
from lightning_megatron.optim.clip import counted_on_this_tensor_rank, counted_squares, reduce_squares
from lightning_megatron.optim.grad_sync import flat_part, sum_over_group, sum_tokens
from lightning_megatron.optim.partial_grads import partial_grad_groups
from lightning_megatron.parallel.initialize import (
    PARAMETER_TAGS,
    default_initializer,
    initialize_buffers,
    initializer_owners,
    local_initial_values,
    original_name,
    rule_for,
)
from lightning_megatron.parallel.names import name_matches
from lightning_megatron.parallel.shards import shard_of
from lightning_megatron.parallel.state import ParallelState


#: The precisions ZeRO-3 runs: its fp32 shards are the main parameters, gathered in the compute dtype.
ZERO3_PRECISIONS = ("32-true", "bf16-true", "bf16-mixed", "16-true")


def local_tensor(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor (an alias: in-place ops on it change the DTensor), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dp_chunk_start(rows: int, dp_rank: int, dp_size: int) -> int:
    """The first of the rows FSDP2 gives ``dp_rank`` (``torch.chunk`` sizes, empty past the end)."""
    return min(dp_rank * -(-rows // dp_size), rows)


def _dp_chunk(values: Tensor, local_rows: int, dp_rank: int, dp_size: int) -> Tensor:
    """FSDP2's dim-0 chunk of ``values`` for ``dp_rank``."""
    return values.narrow(0, dp_chunk_start(values.shape[0], dp_rank, dp_size), local_rows)


def shard_coordinates(param: DTensor) -> tuple[int, int]:
    """(rank, size) of the 1-D mesh that shards ``param``'s rows: dp (x cp), or an expert's expert-data-parallel
    group under expert parallelism."""
    return param.device_mesh.get_local_rank(), param.device_mesh.size()


def flat_chunk_start(tensor: DTensor) -> int:
    """Where this rank's chunk of ``tensor`` (FSDP2's block of rows over its mesh) begins in the flat tp-local
    tensor."""
    rows = tensor.shape[0]
    return dp_chunk_start(rows, *shard_coordinates(tensor)) * (tensor.numel() // rows if rows else 0)


def offload_policy(offload: OffloadSettings, device_type: str) -> OffloadPolicy:
    """FSDP2's policy for ``offload.parameters``, the tier of ZeRO-3's parameters, on a ``device_type`` mesh.

    ``"cpu"``: the sharded parameters and their gradients live in host memory, so the optimizer, which makes its
    state like the parameters, steps there too; pinned on CUDA, where pinning makes the per-layer copies
    asynchronous (without an accelerator there is nothing to pin for, and torch refuses to pin).
    """
    return CPUOffloadPolicy(pin_memory=device_type == "cuda") if offload.parameters == "cpu" else OffloadPolicy()


def _real_buffers(module: nn.Module) -> dict[str, Tensor]:
    """A copy of every buffer that holds values (by name), to put back after ``to_empty``; refuses a meta buffer
    that no ``initialize_buffers()`` of its module fills (its value exists nowhere), as ``initialize_parameters``
    does, before anything is allocated."""
    real, lost = {}, []
    for module_name, submodule in module.named_modules():
        fills = callable(getattr(submodule, "initialize_buffers", None))
        for name, buffer in submodule.named_buffers(recurse=False):
            full_name = f"{module_name}.{name}" if module_name else name
            if not buffer.is_meta:
                real[full_name] = buffer.detach().clone()
            elif not fills:
                lost.append(full_name)
    if lost:
        raise RuntimeError(
            f"Buffers {lost} are on the meta device and no initialize_buffers() of their module fills them, so "
            f"ZeRO-3 cannot materialise them. Create buffers outside the meta context (for example in forward), or "
            f"give their module an initialize_buffers() method that fills them.")
    return real


def _buffers_to(module: nn.Module, device: Union[torch.device, str]) -> None:
    """Every buffer of ``module`` on ``device`` (FSDP's CPU offload concerns the parameters only)."""
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None:
                submodule._buffers[name] = buffer.to(device)


class ZeRO3:
    """The ZeRO-3 sharding of one module; made by :func:`apply_zero3`."""

    def __init__(self, module: nn.Module, state: ParallelState, fsdp_modules: list[FSDPModule],
                 tags: dict[str, dict[str, Any]], offload_parameters: str = "none") -> None:
        self.module, self.state, self.fsdp_modules, self._tags = module, state, fsdp_modules, tags
        self.offload_parameters = offload_parameters
        # Where the shards, their gradients and the optimizer state live; collectives still run on state.device.
        self.shard_device = torch.device("cpu") if offload_parameters == "cpu" else state.device
        self.retag()
        # By parameter name: to_empty (and Lightning's moves) replace the parameter objects.
        names = {id(p): name for name, p in module.named_parameters()}
        self._partial = [(partial.group, [(names[id(p)], start, stop) for p, start, stop in partial.parts])
                         for partial in partial_grad_groups(module.parameters(), state)]

    # ---------------------------------------------------------------- parameters
    def retag(self) -> None:
        """Put our parameter attributes back on the (sharded) parameters; idempotent."""
        for name, param in self.module.named_parameters(remove_duplicate=False):
            for tag, value in self._tags.get(name, {}).items():
                setattr(param, tag, value)

    def initialize(self, seed: int, device: Union[torch.device, str]) -> None:
        """Materialise meta parameters with their layout-invariant values (those of ``initialize_parameters``),
        computing each full parameter once and keeping only this rank's dp chunk of its tp shard.
        Parameters that are already real keep their values."""
        named = dict(self.module.named_parameters())
        if not any(local_tensor(p).is_meta for p in named.values()):
            return
        keep = {name: local_tensor(p).detach().clone() for name, p in named.items() if not local_tensor(p).is_meta}
        kept_buffers = _real_buffers(self.module)
        offloaded = self.offload_parameters == "cpu"
        # Every parameter (FSDP re-pads the shards; tags may be lost), in host memory under CPU offload (FSDP checks).
        # to_empty empties the buffers too: uninitialised memory (stale device memory on CUDA) until refilled below.
        self.module.to_empty(device="cpu" if offloaded else device)
        if offloaded:
            _buffers_to(self.module, device)
        self.retag()
        initialize_buffers(self.module, device, only_meta=False)  # the modules that fill their own buffers
        with torch.no_grad():
            for name, values in kept_buffers.items():  # what the user's __init__ (or a load) put in the others
                self.module.get_buffer(name).copy_(values)
        named = dict(self.module.named_parameters())
        done = {id(named[name]) for name in keep}
        owners = [(owner, owner.initialize_parameter) for _, owner in initializer_owners(self.module)]
        owners.append((self.module, default_initializer))
        with torch.no_grad():
            for name, values in keep.items():
                local_tensor(named[name]).copy_(values)
            for owner, initializer in owners:  # as initialize_parameters: names relative to the owner
                for module_name, submodule in owner.named_modules(remove_duplicate=False):
                    for param_name, param in submodule.named_parameters(recurse=False):
                        if id(param) in done:
                            continue
                        done.add(id(param))
                        name = original_name(param, f"{module_name}.{param_name}" if module_name else param_name)
                        values = local_initial_values(param, name, seed, rule_for(submodule, initializer))  # tp shard
                        local = local_tensor(param)
                        local.copy_(_dp_chunk(values, local.shape[0], *shard_coordinates(param)))

    # ---------------------------------------------------------------- one step
    def start_micro_batch(self, *, sync: bool, backward_passes: int = 1) -> None:
        """``sync=True``: reduce-scatter this micro-batch's gradients (every micro-batch keeps the ZeRO-3
        memory bound); ``sync=False``: accumulate them unsharded and reduce with a later ``sync=True`` one.
        ``backward_passes`` (a pipeline schedule's micro-batches) needs nothing here: FSDP reduces per backward."""
        for fsdp_module in self.fsdp_modules:
            fsdp_module.set_requires_gradient_sync(sync, recurse=False)

    def finish(self, num_tokens: Tensor, backward_scale: float = 1.0, also_sum: Optional[Tensor] = None
               ) -> Optional[Tensor]:
        """Sum partial gradients over their groups (``optim.partial_grads``: tp for sequence parallelism, the
        embedding group for pipeline-tied copies, tp subgroups for replicated ranges), then turn every
        gradient shard into that of the per-token mean.

        ``num_tokens`` is this rank's token count for the step; it is summed over dp here.
        ``backward_scale`` is what the backward passes multiplied the token-summed loss by; it is
        divided out (``GradientSynchronizer.finish``'s contract, so ``StepGradients`` can drive either; so is
        ``also_sum``, summed over dp with the tokens and returned).
        """
        params = [p for p in self.module.parameters() if p.grad is not None]
        # On the training device (NCCL's), also when the gradient shards were offloaded to host memory.
        tokens, also_sum = sum_tokens(num_tokens, self.state.replica_group, self.state.device, also_sum)
        named = dict(self.module.named_parameters())
        for group, parts in self._partial:
            sum_over_group([part for name, start, stop in parts if named[name].grad is not None
                            for part in self._local_part(named[name], start, stop)], group, device=self.state.device)
        scale = 1.0 / (max(float(tokens), 1.0) * backward_scale)
        with torch.no_grad():
            for param in params:
                local_tensor(param.grad).mul_(scale)
        return also_sum

    def _local_part(self, param: nn.Parameter, start: int, stop: int) -> list[Tensor]:
        """The elements ``[start, stop)`` of the tp-local gradient that this rank's dp chunk holds (a view)."""
        local = local_tensor(param.grad)
        first = flat_chunk_start(param) if isinstance(param, DTensor) else 0
        lo, hi = max(start, first), min(stop, first + local.numel())
        return [flat_part(local, lo - first, hi - first)] if lo < hi else []

    def zero(self) -> None:
        """Drop the gradient shards after the optimizer step (``optimizer.zero_grad()`` does the same)."""
        for param in self.module.parameters():
            param.grad = None

    def main_grads(self) -> list[Tensor]:
        """The fp32 gradient shards the optimizer steps on (``MainParamOptimizer``'s contract, for fp16)."""
        return [local_tensor(p.grad) for p in self.module.parameters() if p.grad is not None]

    def drop_grads(self) -> None:
        """Skip this step (an fp16 overflow): torch optimizers leave parameters without a gradient alone."""
        self.zero()

    def remove(self) -> None:
        """Nothing to undo (``GradientSynchronizer``'s teardown contract); the module stays sharded."""

    def grad_squares(self) -> Tensor:
        """This rank's share of the squared global norm (float64, not reduced): its dp shards, a tp-replicated
        parameter on tp rank 0 only, a replicated range of a segmented shard on its primary only, a
        pipeline-tied copy on the first stage only."""
        squares = torch.zeros((), dtype=torch.float64, device=self.shard_device)  # where the gradient shards are
        is_first_tensor_rank = self.state.tensor_parallel_rank == 0
        for param in self.module.parameters():
            if param.grad is None or hasattr(param, "tied_names"):
                continue  # no gradient, or the last stage's copy of a tied embedding
            if not counted_on_this_tensor_rank(param, is_first_tensor_rank):
                continue
            flat_start = flat_chunk_start(param) if isinstance(param, DTensor) else 0
            squares += counted_squares(local_tensor(param.grad), shard_of(param), flat_start=flat_start,
                                       dtype=torch.float64)
        return squares

    def grad_norm(self) -> Tensor:
        """The L2 norm of the global model's gradients, identical on every rank (reduced on the training device)."""
        return reduce_squares(self.grad_squares(), (self.state.replica_group, self.state.model_parallel_group),
                              reduce_device=self.state.device)

    def clip_grad_norm_(self, max_norm: float, norm: Optional[Tensor] = None) -> Tensor:
        """Scale the gradient shards so that the global norm is at most ``max_norm``; returns the norm before.
        ``norm``: this step's global norm if already known (the strategy's non-finite check); no collective then."""
        if norm is None:
            norm = self.grad_norm()
        clip_coef = max_norm / (float(norm) + 1e-6)
        if clip_coef < 1.0:
            with torch.no_grad():
                for param in self.module.parameters():
                    if param.grad is not None:
                        local_tensor(param.grad).mul_(clip_coef)
        return norm

    def gradient_bytes(self) -> int:
        return sum(local_tensor(p.grad).numel() * local_tensor(p.grad).element_size()
                   for p in dict.fromkeys(self.module.parameters()) if p.grad is not None)

    def model_state_bytes(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
        """Per-rank bytes of the parameter, gradient and optimizer-state shards (tensors, not step counters), under
        the keys ZeRO 0-2 report them with; with ``offload_parameters="cpu"`` all three are in host memory (as the
        fp32 main parameters and optimizer state are under ``offload_optimizer``), nothing stays on the device
        but the layers being gathered."""
        params = list(dict.fromkeys(self.module.parameters()))
        state = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()
                                             if isinstance(v, Tensor) and v.dim() > 0]
        nbytes = lambda t: local_tensor(t).numel() * local_tensor(t).element_size()  # noqa: E731
        return {
            "parameters": sum(nbytes(p) for p in params),
            # What the gradient shards take from backward to zero_grad (like LocalGradients: whether or not they are
            # held right now, e.g. after Lightning's zero_grad): each trainable parameter's shard, in fp32.
            "gradients": sum(nbytes(p) for p in params if p.requires_grad),
            "optimizer_state": sum(nbytes(v) for v in state),
        }


def apply_zero3(
    module: nn.Module,
    state: ParallelState,
    *,
    layers_pattern: Union[str, Sequence[str]],
    other_groups: Optional[Sequence[str]] = None,
    mixed_precision: Optional[MixedPrecisionPolicy] = None,
    reshard_after_forward: bool = True,
    offload: OffloadSettings = OffloadSettings(),
) -> ZeRO3:
    """Shard ``module``'s parameters over the dp group of ``state``: one FSDP2 group per submodule matching
    ``layers_pattern`` (``*`` matches one name component, e.g. ``"blocks.*"``) and one for the rest.

    Without ``other_groups`` the rest is one group rooted at ``module``, which must then be the module
    whose ``__call__`` runs the forward (FSDP's root gathers it in its forward hook; parameters tied
    between the embedding and the head can only live in one group, so this is the pp=1 case). Under
    pipelining the stage modules call ``root.embed``/``root.head`` directly: pass the names of this
    stage's other submodules (e.g. ``["embedding"]`` on the first stage, ``["ln_f", "lm_head"]`` on the
    last), each becomes a group of its own, and every parameter must be covered.

    Call it after ``parallelize`` (and the pipeline split); parameters may still be on the meta
    device (then call :meth:`ZeRO3.initialize`). Build the optimizer afterwards, on
    ``module.parameters()``. ``reshard_after_forward=False`` keeps the layers gathered from
    forward to backward (one all-gather per layer and micro-batch less, more memory).
    ``offload.parameters == "cpu"`` (the strategy's ``offload_parameters="cpu"``): the shards, their gradients and
    the optimizer state in host memory (:func:`offload_policy`); each layer is copied to the device for its all-gather.
    """
    if state.mesh is None:
        raise ValueError("ZeRO stage 3 needs torch.distributed and a ParallelState with a mesh.")
    policy = offload_policy(offload, state.replica_mesh.device_type)
    patterns = [layers_pattern] if isinstance(layers_pattern, str) else list(layers_pattern)
    tags = {name: {tag: getattr(p, tag) for tag in PARAMETER_TAGS if hasattr(p, tag)}
            for name, p in module.named_parameters(remove_duplicate=False)}
    layers = [m for name, m in module.named_modules() if name and any(name_matches(p, name) for p in patterns)]
    if not layers:
        raise ValueError(
            f"layers_pattern {layers_pattern!r} matches no submodule of {type(module).__name__}. "
            f"Check it against `[n for n, _ in model.named_modules()]`."
        )
    kwargs: dict[str, Any] = {"mesh": state.replica_mesh, "offload_policy": policy}
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision
    fsdp_modules = []
    if state.expert_data_mesh is not None:  # inside the layers: their experts over the expert-data-parallel group
        fsdp_modules += shard_experts(layers, dict(kwargs, reshard_after_forward=reshard_after_forward),
                                      state.expert_data_mesh)
    fsdp_modules += [fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs) for layer in layers]
    if other_groups is None:
        fsdp_modules.append(fully_shard(module, **kwargs))  # the rest; as FSDP's root it keeps them gathered until backward
    else:
        others = [module.get_submodule(name) for name in other_groups]
        fsdp_modules += [fully_shard(other, reshard_after_forward=reshard_after_forward, **kwargs)
                         for other in others if any(True for _ in other.parameters())]
        left = [name for name, p in module.named_parameters() if not isinstance(p, DTensor)]
        if left:
            raise ValueError(f"other_groups={list(other_groups)} and layers_pattern={layers_pattern!r} leave {left} "
                             f"unsharded; name the submodules that hold them in other_groups.")
    for fsdp_module in fsdp_modules:
        fsdp_module.set_gradient_divide_factor(1.0)  # a SUM over dp: the loss is a token sum, finish() divides
        fsdp_module.set_force_sum_reduction_for_comms(True)
    return ZeRO3(module, state, fsdp_modules, tags, offload.parameters)


def _is_expert(param: nn.Parameter) -> bool:
    return getattr(param, "expert_parallel", False)


def expert_holders(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of ``layers`` (an MoE layer) that hold experts among their children: submodules whose parameters
    are all tagged ``expert_parallel`` (``expert_parallel.apply``); the holder's forward runs every step, where
    the experts' own may not (an expert without tokens, or grouped GEMMs that read the weights)."""
    holders = []
    for layer in layers:
        for module in layer.modules():
            children = [c for c in module.children() if any(True for _ in c.parameters())]
            if any(all(_is_expert(p) for p in c.parameters()) for c in children) and not all(
                    _is_expert(p) for p in module.parameters()):
                holders.append(module)
    return holders


def shard_experts(layers: Sequence[nn.Module], kwargs: dict[str, Any], expert_mesh) -> list[FSDPModule]:
    """ZeRO-3 under expert parallelism (torchtitan's and Megatron-Core's layout): every expert is held by one
    expert-parallel rank and replicated over its expert-data-parallel group (``dp / ep`` ranks), so its parameters
    are sharded, and its gradients reduce-scattered, over that group (``expert_mesh``), not over dp.

    Each expert holder (:func:`expert_holders`, the ``MoE``) becomes one FSDP group on ``expert_mesh`` that manages
    its experts; its other children (router, shared expert, gate) become groups of their own on the dp mesh first,
    so that the holder's group manages the experts only. The layer's group (dp) then takes what is left. A
    holder's own parameters, or a child mixing experts with dense parameters, would fall in the wrong group:
    refused. Then every dp rank holds a distinct piece of every tensor (the experts: 1/ep of them, each cut in
    dp/ep row chunks), so the global norm is the squares summed over dp, as without experts."""
    groups = []
    for holder in expert_holders(layers):
        direct = [name for name, p in holder.named_parameters(recurse=False) if not _is_expert(p)]
        mixed = [name for name, child in holder.named_children()
                 if len({_is_expert(p) for p in child.parameters()}) > 1]
        if direct or mixed:
            raise ValueError(f"ZeRO-3 with expert parallelism shards the experts of {type(holder).__name__} over "
                             f"their expert-data-parallel group and its other parameters over dp, one FSDP group "
                             f"each, but {direct + mixed} mix the two. Keep the experts in a child module of their own.")
        for child in holder.children():
            if any(True for _ in child.parameters()) and not any(_is_expert(p) for p in child.parameters()):
                groups.append(fully_shard(child, **kwargs))
        groups.append(fully_shard(holder, **dict(kwargs, mesh=expert_mesh)))
    return groups


def load_full_state_dict(module: nn.Module, full: Mapping[str, Tensor]) -> None:
    """Copy this rank's tp shard, dp chunk of each entry of ``full`` into ``module``'s (sharded) tensors."""
    with torch.no_grad():
        for name, value in module.state_dict(keep_vars=True).items():
            if name not in full or not isinstance(value, Tensor):
                continue
            shard = shard_of(value)
            source = full[name] if shard is None else shard.local_slice(full[name])
            local = local_tensor(value)
            if isinstance(value, DTensor):
                source = _dp_chunk(source, local.shape[0], *shard_coordinates(value))
            local.copy_(source)
