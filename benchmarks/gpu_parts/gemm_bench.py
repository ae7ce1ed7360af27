"""Part 5: the decode step's GEMMs at batch M = 1-256, as the engine runs them (`F.linear(x, W)`,
bf16, W `[out, in]`, no bias), timed with the BLAS library torch picks by default, with cuBLASLt
preferred, with `torch.matmul(x, W.t())` when that dispatches differently, and with a plain
Triton matmul (gemm_triton.py): which one is fastest, per case, and how close the default comes
to streaming the weights at the device's measured copy bandwidth.

Why: at decode batch sizes the matmuls read their weights once per step and do little math, so
they should run near memory bandwidth; the issue asks where cuBLAS's choice is not the fastest
one the image offers. Cases: the 135M (SmolLM2) and ~1B Llama shapes of part 3
(engine_models.SHAPES) x QKV, O, gate_up, down and the vocab projection x M in M_VALUES, M
outermost, so that when the time share runs out the small (decode) batches are already in.

Timing: CUDA events around each call, median of REPS after WARMUP calls, with a 256 MiB write
before each call: it evicts the weights from L2 (in a real step every layer's weights are cold)
and keeps the GPU busy while the call is launched, so the time is the GPU's, not the launch's.
Bytes moved = weights + activations read + output written. A method that raises or returns a
wrong result is n/a for that case. Writes the full table to $OUT/gemm_bench.md.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gpu_parts.report import FAIL, MISS, PASS, SKIP, Context, Deadline, Row

PART = "5 gemm"
MATMULS = ("qkv", "o", "gate_up", "down", "vocab")
METHODS = ("default", "cublaslt", "matmul", "triton")
LETTERS = {"default": "d", "cublaslt": "L", "matmul": "m", "triton": "T"}
LABELS = {"smollm2-135m": "135M", "llama-1b-hd128": "1B"}  # engine_models.SHAPES' names
M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SMALL_M_VALUES = (1, 16, 32)  # the CPU self-test: both sides of DECODE_M
DECODE_M = 16  # the bandwidth row's batches: M <= 16
TARGET_PCT = 70.0  # of copy bandwidth, default backend, median over M <= DECODE_M
REPS, WARMUP, CPU_REPS = 30, 3, 3
FLUSH_BYTES = 256 << 20  # > L2 (50 MiB on an H100/H200)

Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One matmul `[m, k] x [n, k]^T` of one model."""

    model: str  # "135M" / "1B"
    matmul: str
    m: int
    n: int  # out features
    k: int  # in features

    def nbytes(self, elem: int) -> int:
        """Weights and activations read, output written."""
        return (self.n * self.k + self.m * self.k + self.m * self.n) * elem

    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def tag(self) -> str:
        return f"{self.model} {self.matmul} M={self.m}"


def winner(us: dict[str, float]) -> str | None:
    """The fastest method; a tie goes to the one earlier in METHODS (default first)."""
    if not us:
        return None
    order = {m: i for i, m in enumerate(METHODS)}
    return min(us, key=lambda m: (us[m], order.get(m, len(order))))


@dataclass
class Result:
    case: Case
    us: dict[str, float] = field(default_factory=dict)  # method -> median microseconds
    errors: dict[str, str] = field(default_factory=dict)

    def pct(self, method: str, copy_gbps: float, elem: int) -> float | None:
        """Achieved bytes/s as % of the copy bandwidth."""
        if method not in self.us:
            return None
        gbps = self.case.nbytes(elem) / (self.us[method] * 1e-6) / 1e9
        return 100.0 * gbps / copy_gbps

    def tflops(self, method: str) -> float | None:
        if method not in self.us:
            return None
        return self.case.flops() / (self.us[method] * 1e-6) / 1e12

    def winner(self) -> str | None:
        return winner(self.us)


def matmul_dims(cfg: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(out, in) of each matmul of a LlamaConfig-style shape dict."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or hidden // heads
    return {
        "qkv": ((heads + 2 * kv_heads) * d, hidden),
        "o": (hidden, heads * d),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "vocab": (cfg["vocab_size"], hidden),
    }


def plan_cases(shapes: dict[str, dict[str, int]], m_values: tuple[int, ...]) -> list[Case]:
    """Every M x model x matmul, M outermost (small M first)."""
    dims = {LABELS.get(name, name): matmul_dims(cfg) for name, cfg in shapes.items()}
    return [
        Case(label, mm, m, *dims[label][mm]) for m in m_values for label in dims for mm in MATMULS
    ]


def measure(
    planned: list[Case],
    deadline: Deadline,
    bench: Callable[[Case], Result],
    log: Callable[[str], None],
) -> list[Result]:
    """`bench` each case in order until the deadline; the results so far."""
    results: list[Result] = []
    for case in planned:
        if deadline.expired():
            log(f"time budget spent: {len(planned) - len(results)}/{len(planned)} cases left out")
            break
        results.append(bench(case))
    return results


@contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's preferred BLAS library set to `name` inside, the previous one restored after."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def aten_ops(fn: Callable[[], object]) -> list[str]:
    """The aten operators `fn` dispatches to, in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        fn()
    return recorder.ops


def matmul_dispatch(device: str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether `torch.matmul(x, W.t())` dispatches to the same aten ops as `F.linear(x, W)`,
    and those ops."""
    x = torch.ones(2, 32, device=device, dtype=dtype)
    w = torch.ones(16, 32, device=device, dtype=dtype)
    linear, matmul = aten_ops(lambda: F.linear(x, w)), aten_ops(lambda: torch.matmul(x, w.t()))
    return linear == matmul, ", ".join(linear)


def _triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from gpu_parts.gemm_triton import matmul

    return matmul(x, w)


CALLS: dict[str, Call] = {
    "default": F.linear,
    "cublaslt": F.linear,  # under blas_library("cublaslt")
    "matmul": lambda x, w: torch.matmul(x, w.t()),
    "triton": _triton,
}


def scope(method: str) -> AbstractContextManager[None]:
    return blas_library("cublaslt") if method == "cublaslt" else nullcontext()


def time_us(fn: Callable[[], object], device: str, flush: torch.Tensor | None) -> float:
    """Median microseconds of `fn` (already warmed up): CUDA events with `flush` written before
    each call, or the wall clock on the CPU."""
    if device == "cpu":
        times = []
        for _ in range(CPU_REPS):
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e6)
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    for start, end in zip(starts, ends, strict=True):
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))


def close_enough(out: torch.Tensor, ref: torch.Tensor) -> str:
    """'' when `out` matches `ref` to the dtype's rounding, else what is wrong."""
    if out.shape != ref.shape:
        return f"wrong shape {tuple(out.shape)}"
    err = (out.float() - ref.float()).abs().max().item()
    bound = 1e-2 * ref.float().abs().max().item() + 1e-3
    return "" if err <= bound else f"wrong result: max error {err:.3g} > {bound:.3g}"


class Bench:
    """Times the `methods` on cases; weights made once per (model, matmul), scaled by
    1/sqrt(in) so outputs stay near 1."""

    def __init__(self, device: str, dtype: torch.dtype, methods: list[str], calls: dict[str, Call]):
        self.device, self.dtype, self.methods, self.calls = device, dtype, methods, calls
        self.weights: dict[tuple[str, str], torch.Tensor] = {}
        self.flush = (
            torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device == "cuda" else None
        )

    def weight(self, case: Case) -> torch.Tensor:
        key = (case.model, case.matmul)
        if key not in self.weights:
            w = torch.randn(case.n, case.k, device=self.device, dtype=self.dtype)
            self.weights[key] = w.mul_(case.k**-0.5)
        return self.weights[key]

    def time_method(self, call: Call, x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> float:
        """Warm-up calls (a compile, an algorithm pick), the result checked, then timed."""
        out = ref
        for _ in range(WARMUP):
            out = call(x, w)
        if self.device == "cuda":
            torch.cuda.synchronize()
        wrong = close_enough(out, ref)
        if wrong:
            raise ValueError(wrong)
        return time_us(lambda: call(x, w), self.device, self.flush)

    def __call__(self, case: Case) -> Result:
        x = torch.randn(case.m, case.k, device=self.device, dtype=self.dtype)
        w = self.weight(case)
        result = Result(case)
        ref = F.linear(x, w)
        for name in self.methods:
            try:
                with scope(name):
                    result.us[name] = self.time_method(self.calls[name], x, w, ref)
            except Exception as exc:  # one failing method is n/a here, not a failed part
                lines = str(exc).strip().splitlines() or [""]
                result.errors[name] = f"{type(exc).__name__}: {lines[-1][:120]}"
        return result


def available(ctx: Context, dtype: torch.dtype) -> tuple[list[str], dict[str, str]]:
    """The methods this machine runs, and why each other one does not."""
    methods, skipped = ["default"], {}
    if not ctx.cuda:
        skipped["cublaslt"] = "no CUDA device"
    else:
        try:
            with blas_library("cublaslt"):
                pass
            methods.append("cublaslt")
        except Exception as exc:
            skipped["cublaslt"] = f"cannot prefer cuBLASLt: {str(exc)[:100]}"
    same, ops = matmul_dispatch(ctx.device, dtype)
    if same:
        skipped["matmul"] = f"same aten ops as F.linear ({ops}): same kernels"
    else:
        methods.append("matmul")
    if importlib.util.find_spec("triton") is None:
        skipped["triton"] = "triton not installed"
    elif not ctx.cuda and os.environ.get("TRITON_INTERPRET") != "1":
        skipped["triton"] = "no CUDA device (TRITON_INTERPRET=1 runs it on the CPU)"
    else:
        methods.append("triton")
    return methods, skipped


def _model_order(label: str) -> int:
    labels = list(LABELS.values())
    return labels.index(label) if label in labels else len(labels)


def _cell(r: Result, method: str, copy_gbps: float, elem: int) -> list[str]:
    """us, % of copy bandwidth, TFLOP/s of one method on one case."""
    pct, tf = r.pct(method, copy_gbps, elem), r.tflops(method)
    if pct is None or tf is None:
        return ["n/a" if method in r.errors else "-", "", ""]
    return [f"{r.us[method]:.1f}", f"{pct:.0f}", f"{tf:.2f}"]


def full_table(results: list[Result], copy_gbps: float, elem: int) -> str:
    """Every case, Markdown: per method us, % of copy bandwidth, TFLOP/s; the fastest, and its
    time saved over the default."""
    head = ["model", "matmul", "M", "N", "K"]
    for m in METHODS:
        head += [f"{m} us", f"{m} %bw", f"{m} TF/s"]
    head += ["fastest", "vs default"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        c, best = r.case, r.winner()
        cells = [c.model, c.matmul, str(c.m), str(c.n), str(c.k)]
        for m in METHODS:
            cells += _cell(r, m, copy_gbps, elem)
        gain = ""
        if best is not None and best != "default" and "default" in r.us:
            gain = f"{r.us['default'] / r.us[best]:.2f}x"
        lines.append("| " + " | ".join([*cells, best or "n/a", gain]) + " |")
    return "\n".join(lines)


def compact_table(results: list[Result], copy_gbps: float, elem: int) -> str:
    """One line per model x matmul: the default's % of copy bandwidth at each M, and the
    fastest method's letter."""
    ms = sorted({r.case.m for r in results})
    by_key = {(r.case.model, r.case.matmul, r.case.m): r for r in results}
    rows = list(dict.fromkeys((r.case.model, r.case.matmul) for r in results))
    legend = ", ".join(f"{v} {k}" for k, v in LETTERS.items())
    lines = [
        f"% of copy bw (default) + fastest ({legend}):",
        f"{'model':<5} {'matmul':<8}" + "".join(f"{'M=' + str(m):>7}" for m in ms),
    ]
    for model, mm in sorted(rows, key=lambda key: (_model_order(key[0]), MATMULS.index(key[1]))):
        cells = []
        for m in ms:
            r = by_key.get((model, mm, m))
            pct = None if r is None else r.pct("default", copy_gbps, elem)
            best = None if r is None else r.winner()
            text = "-" if pct is None else f"{pct:.0f}"
            cells.append(f"{text + (LETTERS.get(best, '?') if best else ' '):>7}")
        lines.append(f"{model:<5} {mm:<8}" + "".join(cells))
    return "\n".join(lines)


def bandwidth_row(
    label: str, results: list[Result], copy_gbps: float, elem: int, cuda: bool
) -> Row:
    """The default backend's median % of copy bandwidth over the cases with M <= DECODE_M."""
    check = f"{label} GEMMs at M<={DECODE_M}: weight-read bandwidth"
    target = f">= {TARGET_PCT:.0f}%"
    found = [
        (pct, r.case.tag)
        for r in results
        if r.case.model == label and r.case.m <= DECODE_M
        for pct in [r.pct("default", copy_gbps, elem)]
        if pct is not None
    ]
    if not found:
        return Row(PART, check, SKIP, target=target, note="no case measured (time budget?)")
    median = statistics.median(p for p, _ in found)
    low, high = min(found), max(found)
    value = f"median {median:.0f}% of copy bw"
    note = f"{len(found)} cases; min {low[0]:.0f}% ({low[1]}), max {high[0]:.0f}% ({high[1]})"
    if not cuda:
        return Row(PART, check, SKIP, f"CPU: {value}", target, "no CUDA device; " + note)
    return Row(PART, check, PASS if median >= TARGET_PCT else MISS, value, target, note)


def cublaslt_row(label: str, results: list[Result], skipped: dict[str, str]) -> Row:
    """How often preferring cuBLASLt beats the default, and by how much at most (no target);
    with how often each method was the fastest of all."""
    check = f"{label} cuBLASLt faster than default"
    mine = [r for r in results if r.case.model == label]
    pairs = [r for r in mine if "default" in r.us and "cublaslt" in r.us]
    if not pairs:
        why = skipped.get("cublaslt") or next(
            (r.errors["cublaslt"] for r in mine if "cublaslt" in r.errors), "no case measured"
        )
        return Row(PART, check, SKIP, note=why)
    faster = [r for r in pairs if r.us["cublaslt"] < r.us["default"]]
    note = f"default faster or equal in {len(pairs) - len(faster)}"
    if faster:
        best = max(faster, key=lambda r: r.us["default"] / r.us["cublaslt"])
        gain = best.us["default"] / best.us["cublaslt"]
        note += f"; largest gain {gain:.2f}x ({best.case.tag})"
    wins = [w for r in mine if (w := r.winner()) is not None]
    note += "; fastest of all: " + ", ".join(f"{m} {wins.count(m)}" for m in METHODS if m in wins)
    return Row(PART, check, PASS, f"{len(faster)}/{len(pairs)} cases", note=note)


def method_row(method: str, title: str, results: list[Result], skipped: dict[str, str]) -> Row:
    """An optional method: skipped (why), or on how many cases it ran and was the fastest."""
    if method in skipped:
        return Row(PART, title, SKIP, note=skipped[method])
    ran = sum(method in r.us for r in results)
    fastest = sum(r.winner() == method for r in results)
    errors = [f"{r.case.tag}: {r.errors[method]}" for r in results if method in r.errors]
    status = PASS if results and ran == len(results) else MISS
    value = f"ran {ran}/{len(results)}, fastest in {fastest}"
    return Row(PART, title, status, value, note=errors[0] if errors else "")


def cases_row(results: list[Result], planned: int, copy_note: str) -> Row:
    """How many cases were measured; F.linear failing anywhere is a failure."""
    default_ok = sum("default" in r.us for r in results)
    broken = [f"{r.case.tag}: {r.errors['default']}" for r in results if "default" in r.errors]
    status = PASS if results and default_ok == len(results) else FAIL
    partial = "" if len(results) == planned else "time budget: largest M left out; "
    note = broken[0] if broken else partial + copy_note
    return Row(PART, "cases measured", status, f"{len(results)}/{planned}", note=note)


def summary_rows(
    results: list[Result],
    planned: int,
    copy_gbps: float,
    elem: int,
    cuda: bool,
    skipped: dict[str, str],
    copy_note: str,
) -> list[Row]:
    rows = [cases_row(results, planned, copy_note)]
    for label in dict.fromkeys(r.case.model for r in results):
        rows.append(bandwidth_row(label, results, copy_gbps, elem, cuda))
        rows.append(cublaslt_row(label, results, skipped))
    rows.append(method_row("matmul", "torch.matmul(x, W.t()) vs F.linear", results, skipped))
    rows.append(method_row("triton", "Triton matmul (gemm_triton.py)", results, skipped))
    return rows


def _copy_gbps(ctx: Context) -> tuple[float, str]:
    """Part 2's measured copy bandwidth, or measured here when part 2 did not run."""
    if "copy_gbps" in ctx.shared:
        gbps = float(ctx.shared["copy_gbps"])
        return gbps, f"copy bw {gbps:.0f} GB/s (part 2)"
    from gpu_parts.decode_bench import copy_bandwidth_gbps

    gbps = copy_bandwidth_gbps(ctx.device, (1 << 30) if ctx.cuda else (64 << 20))
    ctx.shared["copy_gbps"] = gbps
    return gbps, f"copy bw {gbps:.0f} GB/s (measured here)"


def run(ctx: Context, deadline: Deadline) -> list[Row]:
    from gpu_parts.engine_models import SHAPES, SMALL_SHAPES

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    elem = torch.empty((), dtype=dtype).element_size()
    copy_gbps, copy_note = _copy_gbps(ctx)
    methods, skipped = available(ctx, dtype)
    default_blas = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1]
    ctx.log(f"methods: {', '.join(methods)} (default BLAS: {default_blas}); skipped: {skipped}")
    planned = plan_cases(
        SMALL_SHAPES if ctx.small else SHAPES, SMALL_M_VALUES if ctx.small else M_VALUES
    )
    bench = Bench(ctx.device, dtype, methods, CALLS)
    results = measure(planned, deadline, bench, ctx.log)
    del bench
    if ctx.cuda:
        torch.cuda.empty_cache()
    for r in results:
        for m, err in r.errors.items():
            ctx.log(f"{r.case.tag} {m}: {err}")
    results.sort(key=lambda r: (_model_order(r.case.model), MATMULS.index(r.case.matmul), r.case.m))
    compact = compact_table(results, copy_gbps, elem)
    title = f"GEMMs, {dtype}, default BLAS {default_blas}, vs {copy_gbps:.0f} GB/s copy bw"
    ctx.log(f"\n{title}\n{compact}")
    if ctx.out_dir is not None:
        text = (
            f"# {title}\n\n% of copy bandwidth: (weights + activations + output) / time; "
            f"skipped: {skipped or 'none'}\n\n{full_table(results, copy_gbps, elem)}\n\n"
            f"```\n{compact}\n```\n"
        )
        (ctx.out_dir / "gemm_bench.md").write_text(text)
    return summary_rows(results, len(planned), copy_gbps, elem, ctx.cuda, skipped, copy_note)
