"""``Megatron3DStrategy``'s arguments: one frozen dataclass, checked and normalised once, before any process exists.

Each argument is spelled twice: a field here (its default, type and documentation) and a parameter of
``Megatron3DStrategy.__init__``, whose flat keyword signature LightningCLI builds ``init_args`` from (configs write
``init_args: tensor_parallel_size: ...``); ``tests/test_strategy_options.py`` holds the two equal. The constructor
hands its arguments to :class:`StrategyOptions`, whose ``__post_init__`` raises ``ValueError`` on a wrong value or
combination in the user's script, rather than after the launch on every rank, in the order below (the order they
have always been checked in, so a user sees the same first error), and derives, once, the forms the rest of the
package takes: ``requested`` (the layout sizes), ``offload`` (``OffloadSettings``), ``fp8_recipe``,
``compile_options``, ``verify_mode`` and ``loss_scaler_settings``. Everything below the strategy takes these options
whole (as torchtitan passes its job config) and never normalises a setting again.

The fields' ``metadata["doc"]`` is the documentation: :func:`arguments_doc` writes it as the strategy's docstring's
``Args:`` section, which LightningCLI's ``--help`` and ``help()`` show.
"""

from __future__ import annotations

import textwrap
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from datetime import timedelta
from typing import Any, Optional, Sequence, Union

from lightning_megatron.context_parallel import VARIANTS as CONTEXT_PARALLEL_ATTENTION
from lightning_megatron.offload.settings import DEFAULT_BUFFER_MB, OffloadSettings
from lightning_megatron.optim.grad_sync import DEFAULT_BUCKET_SIZE_MB
from lightning_megatron.optim.loss_scaler import DynamicLossScaler
from lightning_megatron.optim.nonfinite import NonFiniteCheck
from lightning_megatron.optim.param_gather import check_overlap_param_gather
from lightning_megatron.parallel.config import requested_layout
from lightning_megatron.transforms.recompute import MODES as RECOMPUTE_MODES
from lightning_megatron.transforms.regional_compile import compile_options
from lightning_megatron.pipeline.layout import check_schedule
from lightning_megatron.strategy.diagnostics import DEFAULT_TIMEOUT
from lightning_megatron.tensor_parallel.fp8_plan import Fp8Recipe, check_fp8_options

CHECKPOINT_FORMATS = ("sharded", "full")
VERIFY_MODES = ("recorded", "strict", "off")


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class StrategyOptions:
    """The strategy's settings, as given and checked (each one's documentation: :func:`arguments_doc`).

    Derived once, in ``__post_init__``: ``requested``, the layout arguments (sizes, ``sequence_parallel``,
    ``zero_stage``, ``pipeline_layers_per_stage``), ``"auto"`` sizes still unresolved (:meth:`resolved` fills
    them); ``offload``: the offload tiers; ``fp8_recipe`` (``None``: off); ``compile_options``: ``torch.compile``'s
    keyword arguments (``None``: off); ``verify_mode``: one of :data:`VERIFY_MODES`; ``loss_scaler_settings``: the
    fp16 loss scaler's keyword arguments. ``dataclasses.replace`` checks and derives again.
    """

    tensor_parallel_size: Union[int, str] = field(default=1, metadata=_doc(
        "ranks that split each layer (Megatron's column/row split); keep it within a node. Any of the sizes "
        '(tensor, pipeline, virtual pipeline, context, expert parallel) may be ``"auto"``: the layout planner '
        '(``lightning_megatron.plan``) then chooses them, on every rank alike, as the layout that fits the '
        'devices with the most predicted tokens/s, keeping the other arguments, and logs its choice '
        '(``strategy.auto_choice``).'))
    pipeline_parallel_size: Union[int, str] = field(default=1, metadata=_doc(
        'pipeline ranks; the model needs ``pipeline_blocks()``.'))
    data_parallel_size: Union[int, str] = field(default="auto", metadata=_doc(
        'model replicas; ``"auto"`` takes ``world_size / (tp * cp * pp)``.'))
    sequence_parallel: bool = field(default=False, metadata=_doc(
        'also split LayerNorm/dropout activations along the sequence over tp.'))
    zero_stage: int = field(default=0, metadata=_doc(
        'ZeRO over dp: 1 shards fp32 main params and optimizer state, 2 also gradients, 3 also the parameters '
        '(FSDP2 per transformer layer; gathered for forward and backward).'))
    _: KW_ONLY
    virtual_pipeline_size: Union[int, str] = field(default=1, metadata=_doc(
        'stages per pipeline rank (interleaved 1F1B when > 1).'))
    expert_parallel_size: Union[int, str] = field(default=1, metadata=_doc(
        'ranks that split the experts of Mixture-of-Experts layers, carved out of dp (it must divide '
        "``data_parallel_size``); tokens reach their experts by all-to-all, and the experts' gradients are "
        'reduced over the ranks holding the same experts (ZeRO 1/2 shards them there).'))
    expert_tensor_parallel_size: Optional[int] = field(default=None, metadata=_doc(
        'tensor-parallel ranks that split each expert (Megatron-Core\'s ``expert_tensor_parallel_size``): None '
        '(``tensor_parallel_size``, every expert split like a dense MLP) or 1: each tp rank holds whole experts and the '
        'tp ranks join the dp ranks in expert parallelism (``expert_parallel_size`` then divides tp x dp), attention '
        'still split over tp.'))
    context_parallel_size: Union[int, str] = field(default=1, metadata=_doc(
        "ranks that split every sample's sequence (long context): each holds two of ``2 * cp`` chunks (Megatron's "
        'causal load balancing), attention is exact over the whole sequence (``context_parallel_attention``), and '
        'the weights are replicated over them, so gradients are reduced and ZeRO shards over dp x cp. The model '
        "declares its batch's sequence entries (``sequence_inputs()``)."))
    context_parallel_attention: str = field(default="ring", metadata=_doc(
        '``"ring"`` (default: keys and values passed round the ranks with send/recv, overlapped with each block\'s '
        'compute) or ``"all_gather"`` (one all-gather of keys and values per layer and one SDPA call; suits '
        'grouped-query attention with few key/value heads).'))
    pipeline_schedule: str = field(default="1f1b", metadata=_doc(
        '``"1f1b"``, ``"interleaved_1f1b"`` or ``"gpipe"`` (torch.distributed.pipelining), or a zero-bubble '
        'schedule, whose backward is an input-gradient pass and a weight-gradient pass run in what would be '
        'bubbles (Qi et al. 2024): ``"interleaved_zero_bubble"`` (any ``virtual_pipeline_size``), ``"zbv"`` and '
        '``"dualpipev"`` (``virtual_pipeline_size=2``, stages placed in a V: rank ``r`` runs stages ``r`` and ``2 '
        'pp - 1 - r``). Not with ``zero_stage=3``.'))
    micro_batch_size: int = field(default=1, metadata=_doc(
        'samples per pipeline micro-batch; the per-rank batch is cut into micro-batches.'))
    pipeline_layers_per_stage: Optional[list[int]] = field(default=None, metadata=_doc(
        'layers of each of the ``pp * vpp`` stages (default: even).'))
    activation_checkpointing: str = field(default="none", metadata=_doc(
        '``"none"``, ``"full"`` (recompute each transformer layer in backward) or ``"selective"`` (recompute only '
        "attention's core, Korthikanti et al. 2022); the layers are the model's ``pipeline_blocks()`` layers. "
        'Dropout masks are replayed exactly.'))
    tp_comm_overlap: bool = field(default=False, metadata=_doc(
        "overlap the sequence-parallel forward collectives with the linears' GEMMs too "
        '(``tensor_parallel.overlap``); needs ``sequence_parallel=True`` and tp > 1.'))
    fp8: Optional[str] = field(default=None, metadata=_doc(
        '``"tensorwise"`` or ``"rowwise"``: the GEMMs of the plan\'s column and row linears (attention, MLP, '
        'experts; not the output head) in FP8, their amaxes reduced over the groups that split each tensor, so '
        'the numbers do not depend on tp or cp (``tensor_parallel.fp8``); needs torchao (``[fp8]`` extra). Master '
        'weights, gradients, optimizer state and checkpoints stay as they are. ``None``: off.'))
    fp8_exclude: Sequence[str] = field(default=(), metadata=_doc(
        'module-name patterns (``fnmatch``) kept in high precision, e.g. the first and last layers.'))
    compile: Union[bool, dict] = field(default=False, metadata=_doc(
        "regional compilation: ``torch.compile`` of each ``pipeline_blocks()`` layer's forward, once for all "
        'identical layers (``transforms.regional_compile``); the embedding, head, loss and schedule stay eager. '
        '``True``, or a dict of ``torch.compile`` arguments (``{"backend": "aot_eager"}``, ``{"mode": "max-'
        'autotune-no-cudagraphs"}``; modes that capture CUDA graphs are refused). With dropout off the model '
        'computes the same function (compiled dropout draws other masks than eager). Not with '
        '``activation_checkpointing="selective"``, context or expert parallelism.'))
    loss_scaler: Optional[dict] = field(default=None, metadata=_doc(
        'settings of the fp16 dynamic loss scaler for ``precision="16-true"`` (``initial_scale``, ``min_scale``, '
        "``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis``; Megatron-LM's scheme). A "
        'step with an inf/NaN gradient on any rank is skipped on every rank.'))
    on_nonfinite: str = field(default="error", metadata=_doc(
        'what a NaN/Inf loss (of any micro-batch, on any rank) or global gradient norm does under ``32-true``, '
        '``bf16-true`` and ``bf16-mixed``; checked every step right after the gradients are reduced, before '
        "Lightning's hooks, clipping (which reuses the norm) and the optimizer see them, so no checkpoint of a "
        'broken state is ever written. ``"error"`` (default, as Megatron-LM): raise ``NonFiniteError`` on every '
        'rank, naming the step and the ranks. ``"skip"``: skip the step on every rank (logged as '
        '``skipped_steps``). ``"ignore"``: no check. fp16 (``16-true``, ``16-mixed``) keeps its loss scaler\'s '
        'overflow handling instead.'))
    max_consecutive_skips: int = field(default=10, metadata=_doc(
        'under ``on_nonfinite="skip"``, the most steps in a row that may be skipped; the next non-finite one '
        'raises.'))
    offload_optimizer: Union[bool, str] = field(default=False, metadata=_doc(
        'where the fp32 main parameters and the optimizer state live (ZeRO 0-2): ``"cpu"`` (or ``True``): host '
        'memory, the optimizer steps there (ZeRO-Offload); ``"nvme"``: files under ``offload_path``, stepped tile '
        'by tile through a pool of three host buffers per state stream (reads and writes overlapped with the '
        "update), so host memory stays bounded by the pool (ZeRO-Infinity's optimizer tier); ``False``: the "
        'device. The disk space and host memory it needs are checked on every rank before training; the files are '
        'deleted at teardown. Checkpoints hold the same tensors on every tier, so a checkpoint made with one tier '
        'loads with any other.'))
    offload_parameters: Union[bool, str] = field(default=False, metadata=_doc(
        'ZeRO-3 only: ``"cpu"`` keeps the sharded parameters, their gradients and the optimizer state in host '
        "memory (FSDP2's ``CPUOffloadPolicy``); each layer's parameters are gathered to the device for its "
        'forward and backward.'))
    offload_path: Optional[str] = field(default=None, metadata=_doc(
        'the folder of the ``"nvme"`` tier (a fast local disk); each rank makes its own subfolder.'))
    offload_buffer_mb: float = field(default=DEFAULT_BUFFER_MB, metadata=_doc(
        'the size of each of the ``"nvme"`` tier\'s host buffers (one tile of one stream).'))
    overlap_param_gather: bool = field(default=False, metadata=_doc(
        'ZeRO 1/2 only: start the all-gathers of the updated parameters after the step, one per bucket in forward '
        "order, each waited for by the first module of the next forward that owns its parameters (Megatron-Core's "
        'option). Checkpoints, evaluation and teardown wait first; so must a callback reading parameters between '
        'the step and the next forward (``strategy.wait_for_parameters()``).'))
    overlap_p2p_comm: bool = field(default=True, metadata=_doc(
        'the multi-stage pipeline schedules post each receive as early as they can, so it completes under compute '
        "(Megatron-LM's ``--overlap-p2p-communication``); ``False`` posts it just before its use."))
    bucket_size_mb: float = field(default=DEFAULT_BUCKET_SIZE_MB, metadata=_doc(
        'size of the gradient buckets reduced over dp while backward runs.'))
    pad_vocab_to_multiple_of: int = field(default=128, metadata=_doc(
        'the vocabulary is padded to a multiple of ``tp * this`` (Megatron: 128).'))
    checkpoint_format: str = field(default="sharded", metadata=_doc(
        '``"sharded"`` (default): a checkpoint is a directory in which every rank writes its own shards of the '
        'weights and of the optimizer state (torch.distributed.checkpoint), keyed by global names, so it loads at '
        'any other layout; saved atomically. ``"full"``: one file with the weights gathered on rank 0 (optimizer '
        'state only where it is not sharded). Both kinds load whatever this is set to.'))
    async_checkpoint: bool = field(default=False, metadata=_doc(
        "write sharded checkpoints in a background thread; training pauses only to copy this rank's shards to CPU "
        'memory. The checkpoint appears under its name when complete.'))
    checkpoint_checksums: bool = field(default=True, metadata=_doc(
        'record a CRC-32 of every file of a sharded checkpoint in its ``megatron_3d.json`` (each rank sums the '
        'files it wrote, right after writing them, while they are in the page cache), so that loading can tell a '
        'file whose bytes changed (``verify_checkpoint``, ``lightning-megatron checkpoint verify``). On by '
        'default: summing costs about +0.9 s per GB on a save and +0.2 s per GB on a load on one CPU core (measured '
        'once, ``benchmarks/README.md``, "Recorded results"; less on a real disk), and a damaged shard that '
        'still holds finite numbers is otherwise loaded without a word. ``False`` saves without them.'))
    verify_checkpoint: Union[bool, str] = field(default="recorded", metadata=_doc(
        "what loading a checkpoint checks of its files' content before any tensor is read (a sharded one's files "
        'are shared out over the ranks; a damaged file stops every rank, naming it). ``"recorded"`` (default): '
        'compare the checksums the save recorded; a checkpoint saved without them '
        '(``checkpoint_checksums=False``, or an earlier lightning-megatron) loads unchecked, said once in the '
        'log. ``"strict"`` (or ``True``): the same, and a checkpoint without checksums is refused. ``"off"`` (or '
        '``False``): no comparison (a storage you trust, a faster load). Loaded tensors are always checked to be '
        'finite, whatever this says. A full (single-file) checkpoint is compared with the CRC-32 its archive '
        'records for each record, unless ``"off"``.'))
    process_group_backend: Optional[str] = field(default=None, metadata=_doc(
        "the backend of the default process group; ``None`` takes Lightning's default for the device (gloo on "
        'CPU, NCCL on CUDA).'))
    timeout: Optional[timedelta] = field(default=DEFAULT_TIMEOUT, metadata=_doc(
        'how long a rank waits in a collective (every group of the layout) before it gives up: 10 minutes by '
        "default (Megatron-LM's; torch's gloo default is 30). A rank that stalls blocks every other rank this "
        'long; the error then names the phase and step that were waiting (training step, optimizer step, '
        'checkpoint save, ...). Raise it for slow filesystems or long first steps.'))

    requested: dict[str, Any] = field(init=False, repr=False, compare=False)
    offload: OffloadSettings = field(init=False, repr=False, compare=False)
    fp8_recipe: Optional[Fp8Recipe] = field(init=False, repr=False, compare=False)
    compile_options: Optional[dict[str, Any]] = field(init=False, repr=False, compare=False)
    verify_mode: str = field(init=False, repr=False, compare=False)
    loss_scaler_settings: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in RECOMPUTE_MODES:
            raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r} is not one of "
                             f"{RECOMPUTE_MODES}.")
        derived = dict(fp8_recipe=check_fp8_options(self.fp8, self.fp8_exclude, self.tp_comm_overlap),
                       compile_options=compile_options(self.compile))
        if self.context_parallel_attention not in CONTEXT_PARALLEL_ATTENTION:
            raise ValueError(f"context_parallel_attention={self.context_parallel_attention!r} is not one of "
                             f"{sorted(CONTEXT_PARALLEL_ATTENTION)}.")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}.")
        check_schedule(self.pipeline_schedule, self.virtual_pipeline_size, zero_stage=self.zero_stage)
        if self.pad_vocab_to_multiple_of < 1:
            raise ValueError(f"pad_vocab_to_multiple_of must be >= 1, got {self.pad_vocab_to_multiple_of}.")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format={self.checkpoint_format!r} is not one of {CHECKPOINT_FORMATS}.")
        if self.async_checkpoint and self.checkpoint_format != "sharded":
            raise ValueError("async_checkpoint=True needs checkpoint_format='sharded'.")
        derived["verify_mode"] = verify_mode(self.verify_checkpoint)
        offload = derived["offload"] = OffloadSettings.from_options(
            offload_optimizer=self.offload_optimizer, offload_parameters=self.offload_parameters,
            offload_path=self.offload_path, offload_buffer_mb=self.offload_buffer_mb, zero_stage=self.zero_stage)
        if self.async_checkpoint and offload.optimizer == "nvme":
            raise ValueError("async_checkpoint=True copies this rank's optimizer state into host memory before writing "
                             "it, which the 'nvme' offload tier exists to avoid; use async_checkpoint=False with it.")
        derived["requested"] = requested_layout(
            tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size, sequence_parallel=self.sequence_parallel,
            zero_stage=self.zero_stage, virtual_pipeline_size=self.virtual_pipeline_size,
            pipeline_layers_per_stage=self.pipeline_layers_per_stage, expert_parallel_size=self.expert_parallel_size,
            context_parallel_size=self.context_parallel_size, expert_tensor_parallel_size=self.expert_tensor_parallel_size)
        check_overlap_param_gather(self.overlap_param_gather, self.zero_stage)
        derived["loss_scaler_settings"] = dict(self.loss_scaler or {})
        DynamicLossScaler(**derived["loss_scaler_settings"])  # the settings are checked by building one
        NonFiniteCheck(self.on_nonfinite, self.max_consecutive_skips)  # as are these
        derived["fp8_exclude"] = tuple(self.fp8_exclude)
        for name, value in derived.items():  # frozen: set once, here
            object.__setattr__(self, name, value)

    def resolved(self, sizes: dict[str, Any], pipeline_schedule: str) -> "StrategyOptions":
        """These options with the layout planner's choice for the ``"auto"`` sizes (``auto.AutoChoice``)."""
        return replace(self, **sizes, pipeline_schedule=pipeline_schedule)


def arguments_doc(width: int = 116) -> str:
    """The ``Args:`` section of ``Megatron3DStrategy``'s docstring, from the fields' documentation."""
    lines = ["Args:"]
    for option in fields(StrategyOptions):
        if option.init:
            lines += textwrap.wrap(f"{option.name}: {option.metadata['doc']}", width, initial_indent="    ",
                                   subsequent_indent="        ", break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines) + "\n"


def verify_mode(verify_checkpoint: Union[bool, str]) -> str:
    """``verify_checkpoint`` as one of :data:`VERIFY_MODES` (``True`` is ``"strict"``: before checksums were
    recorded by default it refused a checkpoint without them; ``False`` is ``"off"``)."""
    if isinstance(verify_checkpoint, bool):
        return "strict" if verify_checkpoint else "off"
    if verify_checkpoint not in VERIFY_MODES:
        raise ValueError(f"verify_checkpoint={verify_checkpoint!r} is not one of {VERIFY_MODES} (or True/False, "
                         f"which mean 'strict'/'off').")
    return verify_checkpoint
