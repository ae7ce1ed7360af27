"""Where the CPU extensions' native builds are cached."""

from __future__ import annotations

from kvrelay_kernels.cpu_extension import build_name


def test_native_builds_are_named_per_cpu_flags() -> None:
    """A `-march=native` build is cached under a name carrying the CPU's instruction sets, so
    a home folder shared with a machine lacking AVX-512 never loads this one's build."""
    avx512 = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})
    avx2 = frozenset({"fpu", "avx2"})
    assert build_name("kvrelay_x", avx512) != build_name("kvrelay_x", avx2)
    assert build_name("kvrelay_x", avx2) == build_name("kvrelay_x", frozenset(sorted(avx2)))
    assert build_name("kvrelay_x", avx2).startswith("kvrelay_x_")
    assert build_name("kvrelay_x").isidentifier()  # it is the Python module's name too
