#!/usr/bin/env python
"""One-shot GPU check of kvrelay, for a lent GPU machine: five parts, one table at the end.

  1 kernels   JIT-build the CUDA extension; every kernel against the fp32 torch reference
              (fp16/bf16, GQA, odd lengths, split-K, the engine's strided multi-layer cache)
  2 decode    decode attention: CUDA, Triton, FlexAttention, gather + SDPA at batch 1-256 x
              context 512-8192, as % of the measured device copy bandwidth
  3 engine    the engine on random-weight models built on the spot (SmolLM2-135M's shape
              and a ~1B Llama with head_dim 128):
              - fp32, TF32 off: greedy tokens EQUAL to transformers' on 8 prompts of 3-777
                tokens, with graphs and --enforce-eager (compared up to an EOS)
              - bf16: kernel / CUDA-graph counters; eager tokens equal to graphed ones
              - decode step at batch 1/16/64/256, graphs on (wall and GPU busy time: wall
                <= 1.1x GPU at batch >= 16, 135M; batch 1 <= 0.6 ms 135M, <= 1.0 ms 1B)
                and off; kernels per decoder layer of an eager step (<= 10), by
                differencing two model depths
              - throughput, 256 concurrent (128 in / 128 out): >= 60,000 output tok/s,
                >= 15x transformers' generate_batch, >= 5x its static batch
              - no Triton JIT compile after the engine said it was ready
  4 transfer  KV transfer between two engines in one process (gRPC, NIXL when they import;
              the pinned staging alone always): bytes/s vs copy bandwidth, tokens unchanged
  5 gemm      the decode step's matmuls (QKV, O, gate_up, down, vocab) of both part 3 shapes at
              M = 1-256, bf16: F.linear with torch's default BLAS vs cuBLASLt preferred (and a
              Triton matmul): us, % of copy bandwidth, TFLOP/s, the fastest per case
              ($OUT/gemm_bench.md); the default's median at M <= 16 >= 70% of copy bandwidth

Needs only Python, a CUDA build of torch, Triton and transformers (no network, pip, Ray,
NIXL or FastAPI), and the repository. Every part runs even when an earlier one failed, within
its share of the time budget. The table is also written to $OUT/gpu_check.md when $OUT is set.
Exit code: 0 all passed; 1 something failed; 3 no failure but a target was missed (or a
whole part was skipped on a GPU).

    PYTHONPATH=services:kernels python benchmarks/gpu_check.py              # on a GPU machine
    PYTHONPATH=services:kernels python benchmarks/gpu_check.py --dry-run    # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository alone: its packages (when PYTHONPATH is not set) and tests.kernels' helpers.
for _path in (ROOT / "services", ROOT / "kernels", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(1, str(_path))

from gpu_parts.report import (  # noqa: E402 - after the path set-up
    FAIL,
    Context,
    Deadline,
    Part,
    Row,
    exit_code,
    format_table,
    markdown_table,
    run_all,
    summary,
)

# Name, module in gpu_parts, share of the time budget. Part 1's share pays for the JIT build;
# part 3's for seven engines (fp32 graphed and eager, bf16 graphed and eager per model, a
# 2-layer one), three transformers peers and the profiled steps. Part 5 needs ~10 s (three
# Triton compiles, 270 timed method-cases at ~3 ms each): 5% of 420 s is 21 s.
PARTS = (
    ("1 kernels", "kernels_part", 0.26),
    ("2 decode", "decode_bench", 0.19),
    ("3 engine", "engine_part", 0.40),
    ("4 transfer", "transfer_part", 0.10),
    ("5 gemm", "gemm_bench", 0.05),
)
DEFAULT_BUDGET_S = 420.0  # the parts' budget; start-up and the watchdog's grace fit in 8 min
GRACE_S = 45.0  # past the budget, the watchdog prints what there is and exits


def lazy(module: str) -> Part:
    """The part's `run`, imported when the part starts: a part that cannot even import
    (a missing dependency) fails alone."""

    def run(ctx: Context, deadline: Deadline) -> list[Row]:
        part: Part = importlib.import_module(f"gpu_parts.{module}").run
        return part(ctx, deadline)

    return run


def environment() -> list[str]:
    """What this run ran on, for the report's head."""
    import torch

    lines = [
        f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})"
    ]
    for name in ("triton", "transformers", "grpc"):
        try:
            module = importlib.import_module(name)
            lines.append(f"{name} {getattr(module, '__version__', 'present')}")
        except ImportError:
            lines.append(f"{name}: not installed")
    from kvrelay.transfer.nixl_api import nixl_available

    lines.append(f"NIXL: {'present' if nixl_available() else 'not installed'}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(
            f"GPU {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB"
        )
    from shutil import which

    lines.append(f"nvcc: {which('nvcc') or 'not on the PATH'}")
    return lines


def dispatch_lines() -> list[str]:
    """The decode dispatch's tables the engines made at load (part 3's: one per model shape
    and dtype on the `cuda` backend), one line each, for the report's head."""
    from kvrelay_kernels import decode_dispatch

    tables = decode_dispatch.installed()
    if not tables:
        return ["decode dispatch at load: no table (no engine on the cuda backend ran)"]
    return [f"at load, {table.describe()}" for table in tables]


def report(rows: list[Row], head: list[str], out_dir: Path | None) -> None:
    print("\n" + "\n".join(head))
    print(format_table(rows))
    print(summary(rows))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        text = "\n".join(
            [
                "# kvrelay GPU check",
                "",
                *(f"- {h}" for h in head),
                "",
                markdown_table(rows),
                "",
                summary(rows),
                "",
            ]
        )
        (out_dir / "gpu_check.md").write_text(text)


def watchdog(seconds: float, rows: list[Row], ctx: Context, head: list[str]) -> threading.Timer:
    """Past the budget and its grace, print the table so far (the running part as FAIL) and
    exit: a hung kernel or build must not cost the whole run's results."""

    def fire() -> None:
        running = ctx.shared.get("running", "?")
        final = [
            *rows,
            Row(
                str(running),
                "part overran the time budget",
                FAIL,
                note=f"stopped after {seconds:.0f} s (hung?)",
            ),
        ]
        report(final, head, ctx.out_dir)
        sys.stdout.flush()
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="auto (default): cuda when torch sees a GPU; cpu runs tiny shapes "
        "and reports the CUDA-only checks as SKIP",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the self-test: --device cpu with tiny shapes (any machine)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"time for all parts (default {DEFAULT_BUDGET_S:.0f} s); each part "
        "gets a weighted share and stops early with what it has",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=[p[0].split()[1] for p in PARTS],
        help="run only these parts (default: all)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=os.environ.get("OUT") or None,
        help="folder for gpu_check.md and the detail files (default: $OUT)",
    )
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error("--budget-s must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = "cpu" if args.dry_run else args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: --device cuda, but torch sees no GPU (torch.version.cuda = "
            f"{torch.version.cuda}); use --dry-run for the CPU self-test",
            file=sys.stderr,
        )
        return 2
    # No network here: a Hub lookup (transformers' optional kernels, say) fails at once
    # instead of waiting on DNS. Set before transformers is first imported (environment()).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    head = environment()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-gpu-check-") as work:
        ctx = Context(device, small=device == "cpu", work_dir=Path(work), out_dir=args.out)
        timer = watchdog(args.budget_s + GRACE_S, rows, ctx, head)
        selected = [
            (name, weight, lazy(module))
            for name, module, weight in PARTS
            if args.parts is None or name.split()[1] in args.parts
        ]
        run_all(selected, ctx, args.budget_s, rows)
        timer.cancel()
    report(rows, head + dispatch_lines(), args.out)
    return exit_code(rows, skips_allowed=device == "cpu")


if __name__ == "__main__":
    sys.exit(main())
