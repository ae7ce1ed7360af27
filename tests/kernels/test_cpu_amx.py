"""AMX tile permission (kvrelay_kernels/cpu_amx.py): asked only where the flags show AMX, the
kernel's answer read back, never an exception; the real request runs on whatever CPU runs the
suite. And the CPU summary the worker logs (models/cpu_features.py)."""

from __future__ import annotations

import ctypes
import logging

import pytest

from kvrelay.models.cpu_features import cpu_feature_summary, feature_summary
from kvrelay_kernels.cpu_amx import (
    ARCH_GET_XCOMP_PERM,
    ARCH_REQ_XCOMP_PERM,
    SYS_ARCH_PRCTL,
    XFEATURE_XTILEDATA,
    amx_enabled,
    enable_amx,
    has_amx_flags,
    request_tile_permission,
)
from kvrelay_kernels.cpu_flags import cpu_flags, cpu_model_name

SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})


class FakeKernel:
    """arch_prctl as Linux answers it: grants the tile state when `grants`, and reports the
    granted features through the pointer GET is given."""

    def __init__(self, grants: bool) -> None:
        self.grants = grants
        self.granted = 0
        self.calls: list[tuple[int, int]] = []

    def __call__(self, number: int, code: int, argument: int) -> int:
        assert number == SYS_ARCH_PRCTL
        self.calls.append((code, argument))
        if code == ARCH_REQ_XCOMP_PERM:
            if not self.grants:
                return -1  # EINVAL: no tile state on this CPU, or a filter says no
            self.granted |= 1 << argument
            return 0
        assert code == ARCH_GET_XCOMP_PERM
        ctypes.c_ulong.from_address(argument).value = self.granted | 0b11  # x87, SSE
        return 0


def test_amx_needs_both_the_tiles_and_their_bf16_dot_products() -> None:
    assert has_amx_flags(SAPPHIRE_RAPIDS)
    assert not has_amx_flags(ZEN4)
    assert not has_amx_flags(frozenset({"amx_tile"}))


def test_a_granted_request_is_read_back_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    kernel = FakeKernel(grants=True)
    with caplog.at_level(logging.INFO, logger="kvrelay_kernels.cpu_amx"):
        assert enable_amx(SAPPHIRE_RAPIDS, kernel)
    assert kernel.calls[0] == (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    assert kernel.calls[1][0] == ARCH_GET_XCOMP_PERM
    assert [r.getMessage() for r in caplog.records] == [
        "AMX: tile state granted (amx_tile, amx_bf16); oneDNN's bf16 uses tiles"
    ]


def test_a_refused_request_answers_false_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    kernel = FakeKernel(grants=False)
    with caplog.at_level(logging.INFO, logger="kvrelay_kernels.cpu_amx"):
        assert not enable_amx(SAPPHIRE_RAPIDS, kernel)
    assert kernel.calls == [(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)]  # no read-back
    assert len(caplog.records) == 1 and "refused" in caplog.records[0].getMessage()


def test_a_grant_of_other_features_is_not_a_grant_of_tiles() -> None:
    # The request "succeeds" but the read-back lacks the tile bit: tile code would fault, so
    # the answer is no.
    def forgetful(number: int, code: int, argument: int) -> int:
        if code == ARCH_GET_XCOMP_PERM:
            ctypes.c_ulong.from_address(argument).value = 0b11
        return 0

    assert not request_tile_permission(forgetful)


def test_without_amx_flags_the_kernel_is_never_asked() -> None:
    kernel = FakeKernel(grants=True)
    assert not enable_amx(ZEN4, kernel)
    assert kernel.calls == []


def test_a_missing_syscall_is_a_refusal_not_an_error() -> None:
    def missing(number: int, code: int, argument: int) -> int:
        raise AttributeError("syscall")

    assert not request_tile_permission(missing)


def test_the_real_request_is_harmless_here() -> None:
    # The real arch_prctl on whatever CPU runs the suite: False without AMX (this project's
    # EPYC), and never an exception; asking twice gives the same answer.
    first = request_tile_permission()
    assert first is request_tile_permission()
    if not has_amx_flags(cpu_flags()):
        assert first is False
    assert amx_enabled() is (has_amx_flags(cpu_flags()) and first)


def test_the_model_name_is_read_from_cpuinfo() -> None:
    text = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t: fpu\n"
    assert cpu_model_name(text) == "Intel(R) Xeon(R) Platinum 8481C"
    assert cpu_model_name("processor\t: 0\nFeatures\t: fp asimd\n") == "unknown"
    assert cpu_model_name() != ""


def test_the_summary_names_the_flags_and_amx_state() -> None:
    assert feature_summary("AMD EPYC", ZEN4, False) == (
        "AMD EPYC: avx512_bf16 avx512f avx2; AMX: not on this CPU"
    )
    assert feature_summary("Xeon", SAPPHIRE_RAPIDS, True) == (
        "Xeon: amx_bf16 amx_tile avx512_bf16 avx512f avx2; AMX: granted, oneDNN's bf16 uses tiles"
    )
    assert feature_summary("Xeon", SAPPHIRE_RAPIDS, False).endswith("AMX: refused by the kernel")
    assert feature_summary("old", frozenset({"sse2"}), False) == (
        "old: none of avx2/avx512; AMX: not on this CPU"
    )
    assert cpu_feature_summary().startswith(cpu_model_name() + ": ")
