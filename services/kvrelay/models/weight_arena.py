"""A loaded CPU model's weights moved into one huge-page allocation, in the order a forward
pass reads them (`kvrelay_kernels.host_memory`).

As loaded, the weights lie wherever the allocator put them, each layer's tensors apart and
on 4 KiB pages. A decode step streams all of them, and the hardware prefetchers and the TLB
serve one long run of 2 MiB pages better: on a 2-core Zen 4 EPYC the int8 matmuls of one
decode row took 4.6 instead of 5.5 ms, a fresh 4 KiB-page copy in the same order 4.9 ms
(`benchmarks/huge_pages.py`).

Modules register their tensors as parameters or buffers; one that keeps a tensor elsewhere
too (a kernel's arguments bound once, for speed) defines `rebind_weights()`, which is called
after the move.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from kvrelay_kernels.host_memory import Arena

logger = logging.getLogger(__name__)


def gather_weights(model: nn.Module) -> int:
    """Move every parameter and buffer of `model` (CPU, strided) into one huge-page
    allocation, in module order; returns the bytes moved (0 when none is on the CPU).

    Each tensor is swapped for its copy as soon as it is made, so that the originals are
    freed one by one: the peak is about one model, not two.
    """
    slots: list[tuple[dict[str, Any], str]] = []  # (a module's parameters or buffers, name)
    tensors: list[torch.Tensor] = []
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, tensor in table.items():
                if _movable(tensor):
                    slots.append((table, name))
                    tensors.append(tensor)
    if not tensors:
        return 0
    arena = Arena(tensors)
    del tensors  # the tables hold the originals now, until each is swapped
    # A tied parameter stays one object. Keyed by the original's id: the originals all
    # lived at once, so a live one's id never matches a freed one's.
    replacements: dict[int, nn.Parameter] = {}
    for table, name in slots:
        tensor = table[name]
        new = arena.place(tensor)
        if isinstance(tensor, nn.Parameter):
            param = replacements.get(id(tensor))
            if param is None:
                param = replacements[id(tensor)] = nn.Parameter(new, tensor.requires_grad)
            table[name] = param
        else:
            table[name] = new
    for module in model.modules():
        rebind = getattr(module, "rebind_weights", None)
        if callable(rebind):
            rebind()
    logger.debug(
        "gathered %d weight tensors (%d bytes) into one allocation", len(slots), arena.nbytes
    )
    return arena.nbytes


def _movable(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.device.type == "cpu" and tensor.layout == torch.strided
