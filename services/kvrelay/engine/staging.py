"""One upload per step: the step's small host tensors packed into one reusable host buffer,
pinned on CUDA, and copied to the device in one `non_blocking` copy (issue 14).

A pageable source makes every non_blocking copy a staged, host-blocking one, and a dozen
small uploads cost a dozen launches; one pinned buffer, grown when a step needs more and
reused otherwise, costs one. The host buffer is rewritten only after the previous copy out of
it has finished (a CUDA event: it normally has, since each step syncs on its sampled ids).

Each device op is a trip through torch's dispatcher (~5 us of host time on a GPU), so the
layout is chosen to need few of them: the tensors are grouped by dtype, and one `split` of a
dtype view of the device buffer (kept from step to step) returns a whole group's views. For
a step of 256 decodes (benchmarks/host_overhead.py) the stager made 38 device ops, a slice
and two views per tensor; it makes 5: the copy, a split for each of int64, int32 and bool,
and the decode mask's 4-D view. The host side writes with numpy, one `concatenate` per dtype
straight into the pinned buffer: ~0.5 us a tensor (plus 0.7 us for a torch tensor's
`.numpy()`) where a torch slice, view and `copy_` took ~3 us.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

_ALIGN = 16  # every tensor starts 16-byte aligned: any dtype's view is valid
_PAGE = 4096  # the copy's length is rounded up to this, so its slices can be kept
_KEPT = 64  # layouts (and copy lengths) whose views are kept; all dropped past this
HostArray = torch.Tensor | npt.NDArray[Any]


class StepStager:
    """Packs host tensors into one buffer and uploads them to `device` at once."""

    def __init__(self, device: torch.device, initial_bytes: int = 1 << 16) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.uploads = 0  # copies issued (one per `upload`): tests and the GPU check read it
        self._done: torch.cuda.Event | None = None  # re-recorded after each copy
        self._allocate(initial_bytes)

    def _allocate(self, size: int) -> None:
        """Host and device buffers of `size` bytes (a whole number of pages), and what is
        kept of them from step to step: the host buffer's memory as numpy arrays and the
        device buffer's views, by dtype; the copy's slices, by length; each group layout's
        views."""
        size = -(-size // _PAGE) * _PAGE
        self._host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        self._device = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._host_bytes = self._host.numpy()
        self._host_views: dict[np.dtype[Any], npt.NDArray[Any]] = {}
        self._device_views: dict[torch.dtype, torch.Tensor] = {}
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._views: dict[tuple[torch.dtype, int, tuple[int, ...]], list[torch.Tensor]] = {}

    def upload(self, tensors: Sequence[HostArray]) -> list[torch.Tensor]:
        """The same tensors (torch or numpy, any shape) on the device, as views of one
        buffer filled by one copy.

        The views are valid until the next `upload` overwrites the buffer (in stream order:
        kernels already queued read the old values); a later step with the same layout gets
        the same view objects back (read them, never resize or re-stride them)."""
        entries = [_flat(t) for t in tensors]
        groups, total = _layout(entries)
        if self._done is not None:
            self._done.synchronize()  # the last copy out of the host buffer has finished
        if total > self._host_bytes.size:
            self._allocate(1 << (total - 1).bit_length())
        for group in groups:
            group.write(self._host_view(group.host_dtype), [entries[i][0] for i in group.members])
        if total:
            host, device = self._copy_slices(total)
            device.copy_(host, non_blocking=True)
            self.uploads += 1
        if self.pinned:  # recorded on the stream the copy went to (cuda:N's, not the default)
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(self.device))
        staged = [self._device] * len(tensors)  # each replaced by its view below
        for group in groups:
            for member, view in zip(group.members, self._group_views(group), strict=True):
                staged[member] = view
        for i, tensor in enumerate(tensors):
            if tensor.ndim != 1:  # the only op per tensor: a step's inputs are mostly 1-D
                staged[i] = staged[i].view(tensor.shape)
        return staged

    def _copy_slices(self, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The host and device slices a copy of `total` bytes goes through, its length
        rounded up to a page, kept by length: a step as long as an earlier one makes no new
        slice (a device op) and copies at most a page more."""
        length = -(-total // _PAGE) * _PAGE
        slices = self._copies.get(length)
        if slices is None:
            if len(self._copies) >= _KEPT:
                self._copies.clear()
            slices = self._copies[length] = (self._host[:length], self._device[:length])
        return slices

    def _group_views(self, group: _Group) -> list[torch.Tensor]:
        """`group`'s device views: those of an earlier step with the same layout, else one
        `split` (kept). A decode step's int64 and int32 groups mostly repeat the last
        step's (only the block table's writes change their sizes): at 256 decodes this took
        the upload from 88 to 71 us of CPU time here, with no split for either."""
        key = (group.dtype, group.start, tuple(group.sizes))
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _KEPT:
                self._views.clear()
            views = self._views[key] = group.views(self._device_view(group.dtype))
        return views

    def _host_view(self, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        view = self._host_views.get(dtype)
        if view is None:
            view = self._host_views[dtype] = self._host_bytes.view(dtype)
        return view

    def _device_view(self, dtype: torch.dtype) -> torch.Tensor:
        view = self._device_views.get(dtype)
        if view is None:
            view = self._device_views[dtype] = self._device.view(dtype)
        return view


class _Group:
    """The tensors of one dtype, one after the other from element `start` of the buffer's
    view as that dtype, each padded to a 16-byte boundary."""

    def __init__(self, dtype: torch.dtype, host_dtype: np.dtype[Any]) -> None:
        self.dtype = dtype
        self.host_dtype = host_dtype
        self.align = max(_ALIGN // host_dtype.itemsize, 1)  # in elements
        self.start = 0
        self.numel = 0  # the members and their pads
        self.members: list[int] = []  # indices into the upload's tensors
        # The split's sizes from `start`: each member's, then its pad where it needs one.
        # Each chunk costs ~0.5 us (a tensor made: a 20-chunk split took 9.5 us on this
        # CPU); with a pad for every member, 10-12 of the 32 chunks of a step of 256
        # decodes were empty pads.
        self.sizes: list[int] = []
        self.chunks: list[int] = []  # each member's chunk in the split (0: before `start`)

    def add(self, member: int, numel: int) -> None:
        pad = -numel % self.align
        self.members.append(member)
        self.chunks.append(len(self.sizes) + 1)
        self.sizes += [numel, pad] if pad else [numel]
        self.numel += numel + pad

    def write(self, host: npt.NDArray[Any], arrays: list[npt.NDArray[Any]]) -> None:
        """Copy `arrays` (the members') into `host`, the buffer as this dtype: one numpy
        `concatenate`, the pads included (zeros)."""
        parts: list[npt.NDArray[Any]] = []
        for array in arrays:
            parts.append(array)
            if array.size % self.align:
                parts.append(np.zeros(-array.size % self.align, self.host_dtype))
        np.concatenate(parts, out=host[self.start : self.start + self.numel])

    def views(self, device: torch.Tensor) -> list[torch.Tensor]:
        """Each member's 1-D view of `device` (the buffer as this dtype): one `split`."""
        rest = device.shape[0] - self.start - self.numel
        chunks = device.split([self.start, *self.sizes, rest])
        return [chunks[i] for i in self.chunks]


def _flat(tensor: HostArray) -> tuple[npt.NDArray[Any], torch.dtype]:
    """A host tensor's values as a 1-D numpy array (a view when contiguous; for a dtype numpy
    lacks, such as bfloat16, the same bytes as integers) and its torch dtype."""
    if isinstance(tensor, np.ndarray):
        array = tensor.reshape(-1)
        return array, _TORCH_DTYPES.get(array.dtype) or torch.from_numpy(array[:0]).dtype
    try:
        array = tensor.numpy()
    except TypeError:  # a dtype numpy lacks
        array = tensor.view(_SAME_SIZE_INT[tensor.element_size()]).numpy()
    return array.reshape(-1), tensor.dtype


def _layout(entries: list[tuple[npt.NDArray[Any], torch.dtype]]) -> tuple[list[_Group], int]:
    """The tensors grouped by dtype (in order of first appearance), each group at a 16-byte
    boundary; and the bytes they take in all."""
    groups: dict[torch.dtype, _Group] = {}
    for i, (array, dtype) in enumerate(entries):
        group = groups.get(dtype)
        if group is None:
            group = groups[dtype] = _Group(dtype, array.dtype)
        group.add(i, array.size)
    total = 0
    for group in groups.values():
        group.start = total // group.host_dtype.itemsize
        total += group.numel * group.host_dtype.itemsize
    return list(groups.values()), total


# Torch dtypes numpy lacks (bfloat16, float8) are written as integers of their size: the
# bytes are what go up.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TORCH_DTYPES = {
    np.dtype(d): t
    for d, t in [(np.bool_, torch.bool), (np.int64, torch.int64), (np.int32, torch.int32)]
}
