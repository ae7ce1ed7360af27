"""One upload per step: the step's small host tensors packed into one reusable host buffer,
pinned on CUDA, and copied to the device in one `non_blocking` copy (issue 14).

A pageable source makes every non_blocking copy a staged, host-blocking one, and a dozen
small uploads cost a dozen launches; one pinned buffer, grown when a step needs more and
reused otherwise, costs one. The host buffer is rewritten only after the previous copy out of
it has finished (a CUDA event: it normally has, since each step syncs on its sampled ids).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_ALIGN = 16  # every tensor starts 16-byte aligned: any dtype's view is valid


class StepStager:
    """Packs host tensors into one buffer and uploads them to `device` at once."""

    def __init__(self, device: torch.device, initial_bytes: int = 1 << 16) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.uploads = 0  # copies issued (one per `upload`): tests and the GPU check read it
        self._host = self._host_buffer(initial_bytes)
        self._device = torch.empty(initial_bytes, dtype=torch.uint8, device=device)
        self._done: torch.cuda.Event | None = None

    def _host_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)

    def upload(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The same tensors on the device, as views of one buffer filled by one copy.

        The views are valid until the next `upload` overwrites the buffer (in stream order:
        kernels already queued read the old values)."""
        offsets, total = _layout(tensors)
        if self._done is not None:
            self._done.synchronize()  # the last copy out of the host buffer has finished
        if total > self._host.numel():
            size = 1 << (total - 1).bit_length()
            self._host = self._host_buffer(size)
            self._device = torch.empty(size, dtype=torch.uint8, device=self.device)
        for tensor, offset in zip(tensors, offsets, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            view = self._host[offset : offset + nbytes].view(tensor.dtype)
            view.copy_(tensor.reshape(-1))
        if total:
            self._device[:total].copy_(self._host[:total], non_blocking=True)
            self.uploads += 1
        if self.pinned:  # recorded on the stream the copy went to (cuda:N's, not the default)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(self.device))
        return [
            self._device[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, o in zip(tensors, offsets, strict=True)
        ]


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets: list[int] = []
    total = 0
    for tensor in tensors:
        offsets.append(total)
        nbytes = tensor.numel() * tensor.element_size()
        total += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, total
