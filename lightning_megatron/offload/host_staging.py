"""Device-to-host copies of the reduced gradients into persistent host tensors, asynchronous where the device allows.

The ``"cpu"`` and ``"nvme"`` optimizer tiers step in host memory on fp32 gradients that the accelerator reduced.
Copying each piece with ``grad.to("cpu")`` would make a new pageable tensor per piece per step and block the host
on every copy (the copy engine cannot read pageable memory asynchronously). Here each piece has one *home* made
once, which the step reuses: an fp32 tensor in page-locked memory (``"cpu"`` on CUDA), plain host memory (``"cpu"``
without CUDA: the same numbers as a plain copy), or the memory-mapped gradient file of the ``"nvme"`` tier.

On CUDA the copies run on a side stream, each one queued behind the work already queued on the current stream
(the bucket's reduction and normalisation), with ``non_blocking=True``, so the host goes on queueing work while
they run, and they run while the accelerator finishes the rest of the step's gradient work; :meth:`HostStaging.wait`
is the one synchronisation, on one event, before the host optimizer reads the gradients. Elsewhere a copy is a plain
synchronous ``copy_`` (the device *is* the host, or it has no streams to overlap with).

A bucket whose reduced values need nothing but the normalisation starts earlier (:meth:`HostStaging.copy_reduced`):
when its reduction is launched, in backward, the side stream waits for that reduction alone and copies the reduced
values, in their own dtype, into a second host tensor per piece; :meth:`HostStaging.wait` then normalises them on the
host as ``GradientSynchronizer.finish`` does on the device (the same ``mul_`` by the same scale in the same dtype,
then the widening to fp32), so the host optimizer reads the same bits either way, and 16-bit gradients cross the bus
at 2 bytes an element.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def pinned_host_memory(device: torch.device) -> bool:
    """Whether host tensors that ``device`` copies into should be page-locked: only with CUDA (``pin_memory``
    needs it), where page-locked memory lets the copy engine run the copy while the host goes on."""
    return device.type == "cuda" and torch.cuda.is_available()


def host_tensor(numel: int, *, dtype: torch.dtype, pinned: bool) -> Tensor:
    """A flat host tensor made once and reused every step (page-locked when ``pinned``)."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pinned)


class CopiesQueued:
    """The copies :meth:`HostStaging.copy_reduced` queued on the side stream: :meth:`wait` makes the current stream
    wait for them, so that it does not overwrite what they read (a ``Waitable`` of ``optim.grad_sync``)."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._done = torch.cuda.Event()
        self._done.record(stream)

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._done)


class HostStaging:
    """Copies of device tensors into the persistent host ``homes`` given for them (one per piece, by index)."""

    def __init__(self, homes: list[Optional[Tensor]], device: torch.device,
                 reduced_homes: Optional[list[Optional[Tensor]]] = None) -> None:
        """``homes[i]``: where piece ``i``'s gradient is copied (None: the piece needs no copy, it is read in
        place); ``device``: where the gradients are (the accelerator, or the CPU); ``reduced_homes[i]``: where piece
        ``i``'s reduced, not yet normalised gradient lands when copied early (:meth:`copy_reduced`), in its own
        dtype: ``homes[i]`` itself for fp32 (None: never copied early)."""
        self.homes = homes
        self.reduced_homes = reduced_homes if reduced_homes is not None else [None] * len(homes)
        needed = device.type == "cuda" and any(home is not None for home in homes)
        self._stream = torch.cuda.Stream(device) if needed else None
        self._copied: set[int] = set()
        self._reduced: set[int] = set()  # copied by copy_reduced, not yet given their scale
        self._to_normalise: dict[int, Optional[float]] = {}

    def copy(self, pieces: list[tuple[int, Tensor]]) -> None:
        """Start copying each ``(index, source)`` into piece ``index``'s home (readable after :meth:`wait`).

        On CUDA the copies wait for what the current stream has queued (the reduction that made the sources),
        and with ``non_blocking`` torch converts 16-bit sources to fp32 on the device, so no host temporary
        is made."""
        if not pieces:
            return
        if self._stream is None:
            for index, source in pieces:
                self.homes[index].copy_(source)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(pieces[0][1].device))
            with torch.cuda.stream(self._stream):
                for index, source in pieces:
                    self.homes[index].copy_(source, non_blocking=True)
                    source.record_stream(self._stream)  # its memory is not reused before the copy has read it
        self._copied.update(index for index, _ in pieces)

    def copy_reduced(self, pieces: list[tuple[int, Tensor]], work: Optional[torch.distributed.Work]
                     ) -> Optional[CopiesQueued]:
        """Start copying each ``(index, source)`` into piece ``index``'s reduced home once ``work`` (the reduction
        making the sources; None: they are made) is done; :meth:`normalise` gives them their scale.

        On CUDA the copies are queued on the side stream behind ``work`` alone (``work.wait()`` with the side
        stream current), so they overlap the rest of backward; what is returned is what the current stream must
        wait for before it overwrites the sources. Elsewhere this waits for ``work`` and copies now."""
        if not pieces:
            return None
        if self._stream is None:
            if work is not None:
                work.wait()
            for index, source in pieces:
                self.reduced_homes[index].copy_(source)
            queued = None
        else:
            self._stream.wait_stream(torch.cuda.current_stream(pieces[0][1].device))
            with torch.cuda.stream(self._stream):
                if work is not None:
                    work.wait()
                for index, source in pieces:
                    self.reduced_homes[index].copy_(source, non_blocking=True)
                    source.record_stream(self._stream)
            queued = CopiesQueued(self._stream)
        self._reduced.update(index for index, _ in pieces)
        return queued

    def normalise(self, indices: list[int], scale: Optional[float]) -> None:
        """The sources that :meth:`copy_reduced` copied for ``indices`` were then multiplied by ``scale`` on the
        device (None: left as they were); :meth:`wait` does the same to the copies on the host."""
        for index in indices:
            if index in self._reduced:
                self._reduced.discard(index)
                self._to_normalise[index] = scale
                self._copied.add(index)

    def copied(self, index: int) -> bool:
        """Whether piece ``index`` was copied since the last :meth:`wait`."""
        return index in self._copied

    def wait(self) -> None:
        """Block the host until every copy started since the last call has landed (one event); then normalise the
        early copies into their homes: ``mul_`` in the gradient's dtype, as the device did, then widen to fp32."""
        if self._stream is not None and (self._copied or self._reduced):
            done = torch.cuda.Event()
            done.record(self._stream)
            done.synchronize()
        for index, scale in self._to_normalise.items():
            reduced, home = self.reduced_homes[index], self.homes[index]
            if scale is not None:
                reduced.mul_(scale)
            if reduced is not home:
                home.copy_(reduced)
        self._copied.clear()
        self._reduced.clear()  # copied for a step that never reached finish(): superseded
        self._to_normalise.clear()
