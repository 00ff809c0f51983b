"""Measuring what the planner's memory model predicts: saved activations and peak bytes, exact and allocator-free.

``plan/activations.py`` predicts, term by term, what autograd keeps for backward and what a rank's step holds at its
peak. These probes measure the same quantities on a real forward and backward, on any device, without reading an
allocator (whose caches and slack would blur a few-percent difference):

* :class:`SavedActivations` and :class:`SavedInLayers` count the storages autograd saves for backward
  (``saved_tensors_hooks``), each storage once with its whole ``nbytes`` (a saved view keeps its whole storage
  alive), parameters' storages left out: the first split by whether a ``CoreAttention`` saved it, the second by
  whether a transformer layer did.
* :class:`LiveStorages` logs every storage an op allocates, from allocation to death (a ``TorchDispatchMode``), so
  the peak of live bytes over any stretch of the log is exact.
* :func:`head_loss_peak` is one such measurement: the peak of the output layer and its loss, chunked or not.

``benchmarks/memory`` (``python -m benchmarks.memory activations|peak|logits|formulas|planner``) prints them next to
the formulas; the tests hold the package to them (``tests/test_chunked_loss.py``, ``tests/test_plan.py``).

Example::

    from lightning_megatron.plan.probes import LiveStorages, SavedActivations

    with SavedActivations(model) as saved, LiveStorages() as live:
        loss_sum, tokens = model.loss(input_ids, labels)
        loss_sum.backward()
    print(saved.bytes(), live.peak(excluded=set())[0])
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Iterable, Optional

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class SavedTensorCounter:
    """``saved_tensors_hooks`` calling :meth:`pack` while entered, with :meth:`_enter`/:meth:`_leave` run around each
    forward of ``regions`` (so that :meth:`pack` knows where a tensor was saved). Subclasses count."""

    def __init__(self, regions: Iterable[nn.Module]) -> None:
        self.regions = list(regions)
        self.handles: list = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda saved: saved)

    def pack(self, tensor: Tensor) -> Tensor:
        raise NotImplementedError

    def _enter(self, *_) -> None:
        pass

    def _leave(self, *_) -> None:
        pass

    def __enter__(self):
        for module in self.regions:
            self.handles += [module.register_forward_pre_hook(self._enter), module.register_forward_hook(self._leave)]
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        for handle in self.handles:
            handle.remove()
        self.handles = []


class SavedActivations(SavedTensorCounter):
    """The storages autograd saves for backward while active, each counted once by its ``data_ptr`` with its whole
    ``nbytes`` (``q``, ``k`` and ``v`` are views of one ``qkv`` output), parameters' storages left out (model state,
    not activations). A storage is attributed to ``attention core`` when it is first saved inside a
    ``CoreAttention`` forward (SDPA, the ring, the all-gather of K/V), to ``rest`` otherwise."""

    def __init__(self, module: nn.Module) -> None:
        from lightning_megatron.models.attention import CoreAttention

        super().__init__(m for m in module.modules() if isinstance(m, CoreAttention))
        self.parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages: dict[int, tuple[int, str]] = {}
        self.region = "rest"

    def pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.parameters and pointer not in self.storages:
            self.storages[pointer] = (storage.nbytes(), self.region)
        return tensor

    def _enter(self, *_) -> None:
        self.region = "attention core"

    def _leave(self, *_) -> None:
        self.region = "rest"

    def bytes(self, region: Optional[str] = None) -> int:
        return sum(n for n, where in self.storages.values() if region is None or where == region)


class SavedInLayers(SavedTensorCounter):
    """Bytes autograd saves for backward during the forward inside ``layers`` (the transformer layers): each storage
    once while it lives, parameters' storages left out (model state; under ZeRO-3 the gathered ones too, looked up
    at each save since they come and go), what the backward saves again (recomputation) left out. Storages saved
    outside the layers (embedding, final norm, head, loss, the pipeline's stage outputs) go to ``outside``."""

    def __init__(self, module: nn.Module, layers: list[nn.Module]) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        super().__init__(layers)
        self.module, self.weak = module, StorageWeakRef
        self.live: dict[int, object] = {}
        self.bytes = {"layers": 0, "outside": 0}
        self.depth = 0

    def pack(self, tensor: Tensor) -> Tensor:
        if torch._C._current_graph_task_id() != -1:  # inside backward: a recomputed forward
            return tensor
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        known = self.live.get(pointer)
        if known is not None and not known.expired():
            return tensor
        if pointer in self._parameter_storages():
            return tensor
        self.live[pointer] = self.weak(storage)
        self.bytes["layers" if self.depth else "outside"] += storage.nbytes()
        return tensor

    def _parameter_storages(self) -> set[int]:
        """Where the parameters live now (ZeRO-3 swaps gathered ones in and out; a freed one has no storage)."""
        pointers = set()
        for parameter in self.module.parameters():
            try:
                pointers.add(parameter.untyped_storage().data_ptr())
            except RuntimeError:
                pass
        return pointers

    def _enter(self, *_) -> None:
        self.depth += 1

    def _leave(self, *_) -> None:
        self.depth -= 1


class LiveStorages(TorchDispatchMode):
    """The storages the ops allocate while active, as an event log of ``(+nbytes, id)`` at allocation and
    ``(-nbytes, id)`` when the storage dies (a ``weakref.finalize`` on it: torch keeps one Python object per
    storage for as long as the storage lives, so it dies with the storage, not with a Python reference).

    A storage is new when an op returns it and none of the op's inputs holds it: views, in-place results and
    ``out=`` arguments are storages seen before, or storages from before the mode, which are not counted. Each
    new storage is named by the op that allocated it and whether it ran in backward (the autograd engine's graph
    task); ``backward_start`` is the log's length at the first backward op. (The bookkeeping of
    ``torch.distributed._tools.mem_tracker``, without its module and reference-type tracking.)"""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self.nbytes: list[int] = []  # by id: the current size of each storage seen
        self.names: list[str] = []  # by id: "op (fw|bw)"
        self.backward_start: Optional[int] = None
        self._ids: dict[int, int] = {}  # id() of a live storage -> its id; dropped when it dies, before id() is reused
        self._finalizers: list[weakref.finalize] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        in_backward = torch._C._current_graph_task_id() != -1
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out, in_backward)
        return out

    def observe(self, func, args, kwargs, out, in_backward: bool) -> None:
        """Log the storages ``func`` allocated for ``out`` (another dispatch mode may call this for its ops)."""
        if in_backward and self.backward_start is None:
            self.backward_start = len(self.events)
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, Tensor):
                self._see(tensor.untyped_storage(), inputs, f"{func} ({'bw' if in_backward else 'fw'})")

    def _see(self, storage: torch.UntypedStorage, inputs: set[int], name: str) -> None:
        index = self._ids.get(id(storage))
        if index is not None:  # resized in place (resize_, an out= argument)
            grown = storage.nbytes() - self.nbytes[index]
            if grown:
                self.nbytes[index] += grown
                self.events.append((grown, index))
            return
        if id(storage) in inputs or storage.nbytes() == 0:
            return
        index = len(self.nbytes)
        self._ids[id(storage)] = index
        self.nbytes.append(storage.nbytes())
        self.names.append(name)
        self.events.append((storage.nbytes(), index))
        self._finalizers.append(weakref.finalize(storage, self._died, id(storage), index))

    def _died(self, key: int, index: int) -> None:
        del self._ids[key]
        self.events.append((-self.nbytes[index], index))

    def ids_of(self, tensors: list[Tensor]) -> set[int]:
        """The ids of the counted storages that hold ``tensors`` (call before the mode exits: after it, storages
        die unseen and their ``id()`` may be reused)."""
        found = (self._ids.get(id(t.untyped_storage())) for t in tensors)
        return {index for index in found if index is not None}

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.stop()

    def stop(self) -> None:
        """Storages that outlive the logging no longer log their deaths."""
        for finalizer in self._finalizers:
            finalizer.detach()

    def peak(self, excluded: set[int], stop: Optional[int] = None) -> tuple[int, dict[str, int]]:
        """The peak of the live bytes over ``events[:stop]`` without the ``excluded`` storages, and the five names
        holding the most bytes at that moment."""
        events = [(delta, index) for delta, index in self.events[:stop] if index not in excluded]
        live = peak = peak_at = 0
        for position, (delta, _) in enumerate(events, 1):
            live += delta
            if live > peak:
                peak, peak_at = live, position
        alive = Counter()
        for delta, index in events[:peak_at]:
            alive[index] += delta
        by_name = Counter()
        for index, nbytes in alive.items():
            by_name[self.names[index]] += nbytes
        return peak, {name: nbytes for name, nbytes in by_name.most_common(5) if nbytes}


def head_loss_peak(*, tokens: int, hidden: int, vocab: int, chunk_tokens: Optional[int], group=None,
                   sequence_parallel: bool = False, pad_vocab_to_multiple_of: int = 128, seed: int = 0,
                   softcap: Optional[float] = None) -> dict:
    """Peak bytes of one forward and backward of the output layer and the summed cross-entropy of ``tokens``
    tokens (fp32), unchunked (``chunk_tokens=None``) or chunked (``GPTConfig.loss_chunk_tokens``'s
    ``ChunkedHeadLoss``), the input's and the weight's gradients left out; ``group``: tensor parallelism over it
    (the strategy's ``VocabParallelHead``, padded as the strategy pads), ``sequence_parallel``: each rank holds
    ``tokens / tp`` of the hidden states; ``softcap``: the logits soft-capped (``GPTConfig.final_logit_softcapping``).
    Also returns the loss, so that callers can check both paths computed the
    same thing."""
    import torch.distributed as dist

    from lightning_megatron.tensor_parallel import VocabParallelCrossEntropy, VocabParallelHead
    from lightning_megatron.tensor_parallel.chunked_cross_entropy import ChunkedHeadLoss
    from lightning_megatron.tensor_parallel.logits import soft_cap

    generator = torch.Generator().manual_seed(seed)
    tp = dist.get_world_size(group) if group is not None else 1
    if group is None:
        head = nn.Linear(hidden, vocab, bias=False)
        unchunked = nn.CrossEntropyLoss(reduction="sum")
    else:
        head = VocabParallelHead(hidden, vocab, group=group, sequence_parallel=sequence_parallel,
                                 pad_to_multiple_of=pad_vocab_to_multiple_of)
        unchunked = VocabParallelCrossEntropy(group=group, reduction="sum")
    with torch.no_grad():
        full = torch.randn(head.weight.tensor_shard.global_shape if group is not None else (vocab, hidden),
                           generator=generator) * 0.02
        head.weight.copy_(head.weight.tensor_shard.local_slice(full[:vocab]) if group is not None else full)
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    states = torch.randn(1, tokens, hidden, generator=generator)
    local = tokens // tp if sequence_parallel else tokens
    rank = dist.get_rank(group) if sequence_parallel else 0
    x = states[:, rank * local:(rank + 1) * local].clone().requires_grad_()
    with LiveStorages() as live:
        if chunk_tokens is None:
            loss = unchunked(soft_cap(head(x), softcap).flatten(0, 1), labels.flatten())
        else:
            loss = ChunkedHeadLoss(chunk_tokens=chunk_tokens, softcap=softcap)(x, labels, head)
        loss.backward()
        excluded = live.ids_of([x.grad, head.weight.grad])
    peak, at_peak = live.peak(excluded)
    return {"peak_bytes": peak, "at_peak": at_peak, "loss": loss.item(), "tp": tp,
            "sequence_parallel": sequence_parallel, "chunk_tokens": chunk_tokens,
            "local_vocab": head.weight.shape[0]}
