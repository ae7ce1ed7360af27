"""The `KVRELAY_*` environment variables the kernels read, declared once: name, type, default
and what each does (docs/operations.md lists it; tests/test_env_registry.py checks).

The kernels are beneath kvrelay and cannot import it, so they keep this small registry of
their own; `kvrelay.common.env` holds kvrelay's. Read at call time, never at import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: `get` reads it; the rest documents it."""

    name: str
    type: str
    default: str  # what `get` returns when the variable is unset
    meaning: str
    unset: str = ""  # what an unset variable means, where `default` alone does not say

    def get(self, environ: Mapping[str, str] | None = None) -> str:
        """The value in `environ` (None: `os.environ`, read now), else `default`."""
        return (os.environ if environ is None else environ).get(self.name, self.default)

    def choice(self, choices: tuple[str, ...], environ: Mapping[str, str] | None = None) -> str:
        """The value (empty: `default`), one of `choices`.

        Raises:
            ValueError: another value, naming the variable and the choices.
        """
        value = self.get(environ) or self.default
        if value not in choices:
            raise ValueError(f"{self.name}={value!r}: use one of {', '.join(choices)}")
        return value

    def shown_default(self) -> str:
        """The default as docs/operations.md states it."""
        return self.unset or (f"`{self.default}`" if self.default else "unset")


HUGE_PAGES = EnvVar(
    "KVRELAY_HUGE_PAGES",
    "on / off",
    "1",
    "`0` / `false` / `off` / `no`: no 2 MiB huge-page advice for the weights and the KV cache "
    "(`kvrelay_kernels/host_memory.py`)",
    unset="on (Linux)",
)

DECODE_ATTENTION = EnvVar(
    "KVRELAY_DECODE_ATTENTION",
    "`auto` \\| `cuda` \\| `triton`",
    "auto",
    "kernel of decode attention under the `cuda` backend: `auto` times kvrelay's CUDA kernel "
    "and the Triton one per batch x context bucket on the GPU at load (before CUDA graphs are "
    "captured; one log line shows the table) and takes the faster; `cuda` / `triton` pin one, "
    "refused at load where it cannot run the model (`kvrelay_kernels/decode_dispatch.py`)",
)

REGISTRY: tuple[EnvVar, ...] = (HUGE_PAGES, DECODE_ATTENTION)
