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


class HostStaging:
    """Copies of device tensors into the persistent host ``homes`` given for them (one per piece, by index)."""

    def __init__(self, homes: list[Optional[Tensor]], device: torch.device) -> None:
        """``homes[i]``: where piece ``i``'s gradient is copied (None: the piece needs no copy, it is read in
        place); ``device``: where the gradients are (the accelerator, or the CPU)."""
        self.homes = homes
        needed = device.type == "cuda" and any(home is not None for home in homes)
        self._stream = torch.cuda.Stream(device) if needed else None
        self._copied: set[int] = set()

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

    def copied(self, index: int) -> bool:
        """Whether piece ``index`` was copied since the last :meth:`wait`."""
        return index in self._copied

    def wait(self) -> None:
        """Block the host until every copy started since the last call has landed (one event)."""
        if self._stream is not None and self._copied:
            done = torch.cuda.Event()
            done.record(self._stream)
            done.synchronize()
        self._copied.clear()
