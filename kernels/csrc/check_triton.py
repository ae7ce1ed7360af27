"""`make kernels-check`, third part: compile every Triton kernel ahead of time for sm_80 and
sm_90 with the installed Triton (no GPU needed: Triton compiles to a cubin with its own ptxas),
at the constants the engine launches them with, and report registers and spills.

The CPU tests run these kernels in Triton's interpreter, which never compiles them: a kernel
that uses an API the installed Triton lacks, or that fails to lower for a GPU, shows here
rather than on a lent GPU. Exit 1 on any compile error or spill.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvrelay_kernels import (
    triton_activation,
    triton_attention,
    triton_norm,
    triton_rope_kv,
    triton_sampling,
    triton_write_kv,
)

ARCHS = (80, 90)
# (name, query heads, KV heads, head_dim): SmolLM2-135M, Llama-3-8B, a padded head_dim.
SHAPES = (("smollm2", 9, 3, 64), ("llama8b", 32, 8, 128), ("hd80", 16, 4, 80))
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
BLOCK_SIZE = 16
# The MLP's intermediate size of each shape (the fused kernels' silu_and_mul).
INTERMEDIATE = {"smollm2": 1536, "llama8b": 14336, "hd80": 4096}
_USAGE = re.compile(r"REG:(\d+) .*?LOCAL:(\d+)")


@dataclass(frozen=True)
class Case:
    kernel: str
    config: str
    arch: int
    fn: Any
    signature: dict[str, str]
    constants: dict[str, Any]
    num_warps: int
    options: tuple[tuple[str, Any], ...] = ()  # other launch options (enable_fp_fusion)


@dataclass
class Outcome:
    case: Case
    seconds: float = 0.0
    registers: int = 0
    spill: int = 0
    shared: int = 0
    error: str = ""


def signature(
    fn: Any, pointers: dict[str, str], floats: set[str], constants: dict[str, Any]
) -> dict[str, str]:
    """Triton's signature of `fn`: pointer element types, fp32 scalars, constexprs, and i32
    for every other integer (the launch passes host ints below 2**31 there)."""
    names = fn.arg_names
    unknown = (set(pointers) | floats | set(constants)) - set(names)
    assert not unknown, f"{fn.__name__} has no arguments {sorted(unknown)}"
    kinds = {}
    for name in names:
        if name in pointers:
            kinds[name] = pointers[name]
        elif name in constants:
            kinds[name] = "constexpr"
        else:
            kinds[name] = "fp32" if name in floats else "i32"
    return kinds


# The attention variants compiled besides plain attention (attention_variants.py): Gemma 2's
# windowed and capped layers, and Mistral's / Gemma 3's windowed ones; 16-bit caches only.
VARIANTS = {"window+cap": (True, True), "window": (True, False)}


def attention_cases(arch: int) -> list[Case]:
    cases = []
    for shape, heads, kv_heads, head_dim in SHAPES:
        for dtype, short in DTYPES.items():
            if dtype == torch.float32 and shape != "smollm2":
                continue  # fp32 caches are for tests and CPUs: one shape is enough
            variants = {"": (False, False)}
            if dtype != torch.float32:
                variants |= VARIANTS if dtype == torch.bfloat16 else {"window+cap": (True, True)}
            for all_decode in (True, False):
                for variant, (window, cap) in variants.items():
                    mode = ("decode" if all_decode else "prefill") + (f" {variant}" * bool(variant))
                    shape_ = (heads, kv_heads, head_dim)
                    config = f"{shape} {short} {mode}"
                    cases.append(
                        _attention_case(arch, shape_, dtype, all_decode, window, cap, config)
                    )
    return cases


def _attention_case(
    arch: int,
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    all_decode: bool,
    window: bool,
    cap: bool,
    config: str,
) -> Case:
    """The varlen attention kernel at one shape (query heads, KV heads, head_dim) and dtype."""
    constants = triton_attention.kernel_constants(
        *heads, BLOCK_SIZE, dtype, all_decode, compiled=True, sliding_window=window, soft_cap=cap
    )
    short = DTYPES[dtype]
    tensors = {"out_ptr": short, "q_ptr": short, "cache_ptr": short}
    ints = ("tables_ptr", "seq_lens_ptr", "qsl_ptr", "cu_tiles_ptr")
    pointers = {k: f"*{v}" for k, v in tensors.items()} | {k: "*i32" for k in ints}
    fn = triton_attention._paged_attention_kernel
    return Case(
        "paged_attention",
        config,
        arch,
        fn,
        signature(fn, pointers, {"qk_scale", "cap"}, constants),
        constants,
        triton_attention.NUM_WARPS,
    )


def write_kv_cases(arch: int) -> list[Case]:
    cases = []
    for shape, _, kv_heads, head_dim in SHAPES:
        for short in DTYPES.values():
            constants = triton_write_kv.kernel_constants(kv_heads, head_dim, BLOCK_SIZE)
            pointers = {"key_ptr": f"*{short}", "value_ptr": f"*{short}"}
            pointers |= {"cache_ptr": f"*{short}", "slot_ptr": "*i64"}
            fn = triton_write_kv._write_kv_kernel
            cases.append(
                Case(
                    "write_kv",
                    f"{shape} {short}",
                    arch,
                    fn,
                    signature(fn, pointers, set(), constants),
                    constants,
                    triton_write_kv.NUM_WARPS,
                )
            )
    return cases


def fused_cases(arch: int) -> list[Case]:
    """The fused element-wise kernels (triton_norm, triton_activation, triton_rope_kv) at each
    shape's hidden size (heads * head_dim), intermediate size and cache, in every dtype; the
    GPU path of silu (libdevice's exp), 16-element-aligned rows (the model's)."""
    cases = []
    for shape, heads, kv_heads, head_dim in SHAPES:
        for short in DTYPES.values():
            hidden = heads * head_dim
            for add in (False, True):
                constants = triton_norm.kernel_constants(hidden, add)
                norm_ptrs = ("x_ptr", "delta_ptr", "weight_ptr", "out_ptr")
                fn = triton_norm._rms_norm_kernel
                cases.append(
                    Case(
                        "add_rms_norm" if add else "rms_norm",
                        f"{shape} {short}",
                        arch,
                        fn,
                        signature(fn, dict.fromkeys(norm_ptrs, f"*{short}"), {"eps"}, constants),
                        constants,
                        triton_norm.num_warps(hidden),
                    )
                )
            constants = triton_activation.kernel_constants(INTERMEDIATE[shape], True)
            fn = triton_activation._silu_and_mul_kernel
            pointers = dict.fromkeys(("gate_up_ptr", "out_ptr"), f"*{short}")
            cases.append(
                Case(
                    "silu_and_mul",
                    f"{shape} {short}",
                    arch,
                    fn,
                    signature(fn, pointers, set(), constants),
                    constants,
                    triton_activation.NUM_WARPS,
                )
            )
            constants = triton_rope_kv.kernel_constants(heads, kv_heads, head_dim, BLOCK_SIZE)
            fn = triton_rope_kv._rope_kv_kernel
            rope_ptrs = ("qkv_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "cache_ptr")
            pointers = dict.fromkeys(rope_ptrs, f"*{short}") | {"slot_ptr": "*i64"}
            cases.append(
                Case(
                    "rope_and_write_kv",
                    f"{shape} {short}",
                    arch,
                    fn,
                    signature(fn, pointers, set(), constants),
                    constants,
                    triton_rope_kv.NUM_WARPS,
                    tuple(triton_rope_kv.LAUNCH_OPTIONS.items()),
                )
            )
    return cases


def sampling_cases(arch: int) -> list[Case]:
    """The batch sampler, with top_k as the engine passes it (int32) and as int64. The
    vocabulary is a runtime argument (one cubin for SmolLM2's 49152 and Llama-3's 128256:
    both multiples of 16, which is all Triton specializes an int on)."""
    cases = []
    fn = triton_sampling._sample_rows_kernel
    constants = triton_sampling.kernel_constants(libdevice_exp=True)
    floats = ("x_ptr", "temp_ptr", "top_p_ptr", "min_p_ptr", "u_ptr")
    for k_type in ("i32", "i64"):
        pointers = dict.fromkeys(floats, "*fp32") | {"top_k_ptr": f"*{k_type}", "out_ptr": "*i64"}
        cases.append(
            Case(
                "sample_rows",
                f"vocab 49152/128256 k {k_type}",
                arch,
                fn,
                signature(fn, pointers, set(), constants),
                constants,
                triton_sampling.NUM_WARPS,
            )
        )
    return cases


def compile_case(case: Case) -> Outcome:
    """Compile `case` to a cubin and read its registers and spills."""
    outcome = Outcome(case)
    start = time.perf_counter()
    try:
        source = ASTSource(fn=case.fn, signature=case.signature, constexprs=case.constants)
        target = GPUTarget("cuda", case.arch, 32)
        options = {"num_warps": case.num_warps, **dict(case.options)}
        compiled = triton.compile(source, target=target, options=options)
        outcome.shared = int(getattr(compiled.metadata, "shared", 0))
        outcome.registers, outcome.spill = resource_usage(compiled.asm["cubin"])
    except Exception as exc:  # a compile error is the finding: reported, not raised
        outcome.error = f"{type(exc).__name__}: {str(exc).strip()[-2000:]}"
    outcome.seconds = time.perf_counter() - start
    return outcome


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local-memory bytes: spills) of the kernel in `cubin`, read by the cuobjdump
    bundled with Triton (its ptxas choice varies by release; the cubin is what it made)."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        cmd = [str(cuobjdump), "--dump-resource-usage", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    usage = _USAGE.search(done.stdout)
    if usage is None:
        raise RuntimeError(f"cuobjdump reported no resource usage:\n{done.stdout[-1000:]}")
    return int(usage.group(1)), int(usage.group(2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, action="append", help="override the target archs")
    parser.add_argument("--quick", action="store_true", help="one case per kernel and arch")
    args = parser.parse_args(argv)
    cases = [
        c
        for a in args.arch or ARCHS
        for c in attention_cases(a) + write_kv_cases(a) + fused_cases(a) + sampling_cases(a)
    ]
    if args.quick:
        cases = list({(c.kernel, c.arch): c for c in cases}.values())
    print(f"triton {triton.__version__}: compiling {len(cases)} kernel configurations")
    outcomes = [compile_case(c) for c in cases]
    print(f"{'kernel':<18} {'config':<34} arch  regs  smem(B)  spill(B)  seconds")
    for o in outcomes:
        c = o.case
        status = "  <-- SPILL" if o.spill else ("  <-- ERROR" if o.error else "")
        print(
            f"{c.kernel:<18} {c.config:<34} sm_{c.arch} {o.registers:>5} {o.shared:>8} "
            f"{o.spill:>9} {o.seconds:>8.1f}{status}"
        )
    errors = [o for o in outcomes if o.error]
    for o in errors:
        print(
            f"ERROR {o.case.kernel} {o.case.config} sm_{o.case.arch}:\n{o.error}", file=sys.stderr
        )
    spills = [o for o in outcomes if o.spill]
    print(f"{len(outcomes)} compiled; {len(errors)} errors; {len(spills)} spilling")
    return 1 if errors or spills else 0


if __name__ == "__main__":
    sys.exit(main())
