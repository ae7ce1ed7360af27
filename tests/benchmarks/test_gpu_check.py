"""benchmarks/gpu_check.py on the CPU: the whole script in its self-test mode (tiny shapes,
CUDA-only checks SKIP) with Ray, gRPC, FastAPI and NIXL made unimportable, as on the bare GPU
machine; its one table and Markdown file; a failing part not stopping the next; the time
budget's slices; exit codes; the watchdog; and the checks' own arithmetic."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPT = BENCH / "gpu_check.py"
# What the bare GPU machine lacks: the script must run with none of them importable.
ABSENT = ("ray", "grpc", "fastapi", "uvicorn", "nixl", "nixl._api", "kopf", "kubernetes")
PARTS = ("1 kernels", "2 decode", "3 engine", "4 transfer", "5 gemm")


@pytest.fixture(scope="module")
def gpu_parts() -> dict[str, ModuleType]:
    sys.path.insert(0, str(BENCH))
    import gpu_check
    from gpu_parts import decode_bench, engine_part, report

    return {"check": gpu_check, "report": report, "decode": decode_bench, "engine": engine_part}


def run_blocked(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The script as `python benchmarks/gpu_check.py ARGS`, with ABSENT unimportable."""
    wrapper = textwrap.dedent(f"""
        import runpy, sys
        for name in {ABSENT!r}:
            sys.modules[name] = None  # import raises ImportError
        sys.argv = [{str(SCRIPT)!r}, *{args!r}]
        sys.path.insert(0, {str(BENCH)!r})
        runpy.run_path({str(SCRIPT)!r}, run_name="__main__")
    """)
    return subprocess.run(
        [sys.executable, "-c", wrapper],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        timeout=400,
    )


@pytest.fixture(scope="module")
def dry_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("out")
    proc = run_blocked(["--dry-run", "--out", str(out)], out)
    return proc, out


def table_rows(stdout: str) -> list[list[str]]:
    """The final table's rows, split on its column gaps (the lines after the dashes)."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if set(line) == {"-"})
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith(PARTS):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_help_says_what_it_runs_and_how() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    for words in ("--dry-run", "--budget-s", "$OUT", "PYTHONPATH=services:kernels", "Exit code"):
        assert words in proc.stdout


def test_the_dry_run_passes_without_ray_grpc_fastapi_or_nixl(
    dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table_rows(proc.stdout)
    assert {r[0] for r in rows} == set(PARTS)
    assert all(r[2] in ("PASS", "SKIP") for r in rows), rows
    by_check = {r[1]: r for r in rows}
    # The real checks ran on the CPU: kernels through the harness, greedy tokens, transfers.
    assert by_check["cpu backend, decode (harness self-test)"][2] == "PASS"
    variants = by_check["cpu backend, mixed step, sliding window / soft cap"]
    assert variants[2] == "PASS" and variants[3].startswith("5/5 cases"), variants
    for mode in ("graphs", "--enforce-eager"):
        row = by_check[f"135M fp32: greedy tokens == transformers, {mode}"]
        assert row[2:5] == ["PASS", "8/8 equal", "all equal"], row
    assert by_check["135M: eager tokens vs graphed (--enforce-eager)"][2] == "PASS"
    assert by_check["staging: tokens unchanged"][2] == "PASS"
    # Every new part 3 row's code path ran: profiled steps, both transformers peers, kernels
    # per layer (CPU ops on a CPU), the JIT counter.
    assert by_check["135M decode step, graphs, batch 1"][4] == "<= 0.6 ms"
    assert by_check["1B decode step, graphs, batch 1"][4] == "<= 1.0 ms"
    assert by_check["135M throughput, 8 concurrent (16 in / 8 out)"][2] == "PASS"
    assert by_check["135M throughput vs transformers generate_batch"][2] == "PASS"
    assert by_check["135M throughput vs transformers static batch"][2] == "PASS"
    layers = by_check["135M kernels per decoder layer (eager decode step)"]
    assert "CPU ops per layer" in layers[3] and "counted CPU ops" in layers[-1]
    jit = by_check["no Triton JIT compile after the engine was ready"]
    assert jit[2] == "SKIP" and "after ready" in jit[3]
    # gRPC and NIXL were blocked: reported, not crashed.
    for name in ("grpc", "nixl"):
        row = by_check[f"{name}: tokens unchanged"]
        assert row[2] == "SKIP" and "n/a" in row[-1]
    # CUDA-only checks say why they were skipped.
    assert by_check["CUDA extension JIT build"][-1] == "no CUDA device"
    assert "grpc: not installed" in proc.stdout


def test_the_table_is_printed_once_and_written_as_markdown(
    dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, out = dry_run
    headers = [
        line for line in proc.stdout.splitlines() if line.split()[:3] == ["part", "check", "status"]
    ]
    assert len(headers) == 1
    text = (out / "gpu_check.md").read_text()
    assert "| part | check | status | value | target | note |" in text
    md_rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(md_rows) - 1 == len(table_rows(proc.stdout))
    assert (out / "decode_bench.md").is_file()


def test_a_failing_part_does_not_stop_the_next(gpu_parts: dict[str, ModuleType]) -> None:
    report = gpu_parts["report"]
    ctx = report.Context("cpu", small=True, work_dir=Path("."))

    def broken(ctx: Any, deadline: Any) -> list[Any]:
        raise RuntimeError("first line\nCUDA error: device-side assert triggered")

    def fine(ctx: Any, deadline: Any) -> list[Any]:
        return [report.Row("b", "works", report.PASS, "1")]

    rows = report.run_all([("a", 1.0, broken), ("b", 1.0, fine)], ctx, 10.0)
    assert [(r.part, r.status) for r in rows] == [("a", "FAIL"), ("b", "PASS")]
    assert rows[0].note == "RuntimeError: CUDA error: device-side assert triggered"
    assert report.exit_code(rows, skips_allowed=True) == 1


def test_each_part_gets_its_share_of_what_is_left(gpu_parts: dict[str, ModuleType]) -> None:
    report = gpu_parts["report"]
    now = [0.0]
    shares: list[float] = []

    def part(spend: float) -> Any:
        def run(ctx: Any, deadline: Any) -> list[Any]:
            shares.append(deadline.left())
            now[0] += spend
            return []

        return run

    ctx = report.Context("cpu", small=True, work_dir=Path("."))
    parts = [("a", 1.0, part(10.0)), ("b", 1.0, part(100.0)), ("c", 2.0, part(0.0))]
    report.run_all(parts, ctx, 100.0, clock=lambda: now[0])
    # a: 100 x 1/4; b: of the 90 left, 1/3; c: nothing left after b overran.
    assert shares == pytest.approx([25.0, 30.0, 0.0])


@pytest.mark.parametrize(
    ("statuses", "skips_allowed", "code"),
    [
        (["PASS", "PASS"], False, 0),
        (["PASS", "FAIL"], True, 1),
        (["PASS", "MISS"], False, 3),
        (["MISS", "FAIL"], False, 1),
        (["SKIP", "PASS"], True, 0),  # CPU self-test: a skipped part is expected
        ([], True, 1),  # nothing ran: not a pass
    ],
)
def test_exit_codes(
    gpu_parts: dict[str, ModuleType], statuses: list[str], skips_allowed: bool, code: int
) -> None:
    report = gpu_parts["report"]
    rows = [report.Row(f"part{i}", "x", s) for i, s in enumerate(statuses)]
    assert report.exit_code(rows, skips_allowed=skips_allowed) == code


def test_a_wholly_skipped_part_fails_a_gpu_run(gpu_parts: dict[str, ModuleType]) -> None:
    report = gpu_parts["report"]
    rows = [
        report.Row("1", "a", "PASS"),
        report.Row("2", "b", "SKIP"),
        report.Row("2", "c", "SKIP"),
    ]
    assert report.exit_code(rows, skips_allowed=False) == 3
    rows.append(report.Row("2", "d", "PASS"))
    assert report.exit_code(rows, skips_allowed=False) == 0


def test_rows_refuse_unknown_statuses_and_markdown_escapes_pipes(
    gpu_parts: dict[str, ModuleType],
) -> None:
    report = gpu_parts["report"]
    with pytest.raises(ValueError, match="status"):
        report.Row("1", "x", "OK")
    text = report.markdown_table([report.Row("1", "a|b", "PASS")])
    assert "| 1 | a\\|b | PASS |" in text


def test_the_watchdog_prints_what_there_is_and_exits(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(BENCH)!r})
        import gpu_check
        from gpu_parts.report import Context, Row
        ctx = Context("cpu", small=True, work_dir=Path("."), out_dir=Path({str(tmp_path)!r}))
        ctx.shared["running"] = "3 engine"
        gpu_check.watchdog(0.2, [Row("1 kernels", "build", "PASS")], ctx, ["head"])
        time.sleep(30)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert proc.returncode == 1
    assert "part overran the time budget" in proc.stdout and "1 kernels" in proc.stdout
    assert "3 engine" in (tmp_path / "gpu_check.md").read_text()


def test_decode_bench_plans_every_shape_and_checks_its_targets(
    gpu_parts: dict[str, ModuleType],
) -> None:
    bench = gpu_parts["decode"]
    planned = bench.shapes([1, 16, 64, 256], [512, 2048, 8192])
    assert len(planned) == 24 and planned[0].batch == 256 and planned[0].context == 8192
    llama = next(s for s in planned if s.model == "llama8b" and s.batch == 64 and s.context == 2048)
    assert llama.kv_bytes(2) == 2 * 64 * 2048 * 8 * 128 * 2
    slow = bench.Result(llama, us={"cuda": llama.kv_bytes(2) / 0.5e3, "flex": 1.0})
    assert slow.percent("cuda", 1.0, 2) == pytest.approx(50.0)
    assert len(bench.check_targets([slow], 1.0, 2)) == 2  # under 70%, slower than flex
    fast = bench.Result(llama, us={"cuda": llama.kv_bytes(2) / 0.9e3, "flex": 1e9})
    assert bench.check_targets([fast], 1.0, 2) == []
    rows = bench._target_rows([slow], 1.0, 2, True)
    assert [r.status for r in rows] == ["MISS", "MISS"]
    assert [r.status for r in bench._target_rows([fast], 1.0, 2, True)] == ["PASS", "PASS"]


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_paged_block_mask_maps_each_sequence_to_its_pages(gpu_parts: dict[str, ModuleType]) -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    bench = gpu_parts["decode"]
    pages = torch.tensor([[3, 0], [1, 2]])
    dense = bench.paged_block_mask(pages, total_tokens=4 * 128, page=128).to_dense()
    assert dense[0, 0, 0].tolist() == [1, 0, 0, 1]
    assert dense[1, 0, 0].tolist() == [0, 1, 1, 0]


class FakeLM(torch.nn.Module):
    """A 'model' whose next-token logits are fixed: what logit_gap reads."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.logits = torch.tensor(logits)

    def forward(self, ids: torch.Tensor) -> Any:
        return type("Out", (), {"logits": self.logits.expand(1, ids.shape[1], -1)})()


@pytest.mark.parametrize(
    ("logits", "status"), [([0.0, 5.0, 5.0005], "PASS"), ([0.0, 1.0, 5.0], "FAIL")]
)
def test_greedy_may_part_from_transformers_only_at_a_near_tie(
    gpu_parts: dict[str, ModuleType], logits: list[float], status: str
) -> None:
    engine = gpu_parts["engine"]
    ctx = gpu_parts["report"].Context("cpu", small=True, work_dir=Path("."))
    prompts = [[1, 1], [1]]
    # Equal on the first prompt; on the second, ours took token 1 where transformers took 2.
    ours, theirs = [[2, 2], [1, 0]], [[2, 2], [2, 0]]
    row = engine.compare_greedy(ctx, "greedy", FakeLM(logits), prompts, ours, theirs)
    assert row.status == status and row.value == "1/2 equal" and row.check == "greedy"
    assert ("near-tie" in row.note) == (status == "PASS")


def test_counter_rows_need_the_decode_kernel_and_graph_replays(
    gpu_parts: dict[str, ModuleType],
) -> None:
    engine = gpu_parts["engine"]
    ran = engine.counter_rows("135M", {"cuda_decode_calls": 30, "graph_replays": 12}, True)
    assert [r.status for r in ran] == ["PASS", "PASS"]
    eager = engine.counter_rows("135M", {"cuda_decode_calls": 0, "graph_replays": 0}, True)
    assert [r.status for r in eager] == ["FAIL", "FAIL"]
    # Every decode given to Triton by the dispatch: the kernel row still passes.
    triton = {"cuda_decode_calls": 0, "triton_decode_calls": 30, "graph_replays": 12}
    assert [r.status for r in engine.counter_rows("135M", triton, True)] == ["PASS", "PASS"]
    assert [r.status for r in engine.counter_rows("135M", {}, True)] == ["SKIP", "SKIP"]
    assert [r.status for r in engine.counter_rows("135M", {}, False)] == ["SKIP", "SKIP"]


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")
def test_the_profiler_row_runs_decode_steps_and_reads_kernel_names(
    gpu_parts: dict[str, ModuleType], tmp_path: Path
) -> None:
    """On the CPU no CUDA kernel runs, so the row fails, but it gets there: requests started,
    5 steps profiled, kernel names read, every request aborted after."""
    from gpu_parts import engine_models

    engine_part = gpu_parts["engine"]
    ctx = gpu_parts["report"].Context("cpu", small=True, work_dir=tmp_path)
    folder, hf = engine_models.build_model(ctx, "smollm2-135m")
    engine = engine_models.make_engine(ctx, folder, eager=False, max_num_seqs=8,
                                       kv_cache_memory="16MiB")  # fmt: skip
    row = engine_part.profiler_row("135M", engine, hf.config.vocab_size)
    assert row.status in ("FAIL", "SKIP"), row
    if row.status == "FAIL":
        expected = "paged_decode kernels 0, Triton attention kernels 0, graph launches 0"
        assert row.value == f"{expected} in 5 steps"
    assert not engine.has_unfinished_requests()
    ms = engine_part.step_ms(engine, 2, hf.config.vocab_size, steps=3)
    assert ms > 0 and not engine.has_unfinished_requests()


def _kernel_harness() -> ModuleType:
    from gpu_parts import kernels_part

    return kernels_part


def _reference_call(kp: ModuleType, shift: float = 0.0, leave_rows: int = 0) -> Any:
    """The torch reference as a 'kernel', optionally wrong by `shift`, or leaving its last
    `leave_rows` rows unwritten (NaN)."""
    from kvrelay_kernels import reference

    def call(q: Any, kv: Any, tables: Any, lens: Any, qsl: Any, max_len: int, scale: float,
             out: Any) -> Any:  # fmt: skip
        result = reference.paged_attention(q, kv, kp.LAYER, tables, lens, qsl, scale) + shift
        rows = out.shape[0] - leave_rows
        out[:rows] = result[:rows]
        return out

    return call


@pytest.mark.parametrize(
    ("shift", "leave_rows", "status", "why"),
    [(0.0, 0, "PASS", ""), (0.1, 0, "FAIL", "relative difference"),
     (0.0, 1, "FAIL", "rows left unwritten")],
)  # fmt: skip
def test_the_kernel_harness_catches_a_wrong_kernel(
    gpu_parts: dict[str, ModuleType], shift: float, leave_rows: int, status: str, why: str
) -> None:
    kp = _kernel_harness()
    ctx = gpu_parts["report"].Context("cpu", small=True, work_dir=Path("."))
    deadline = gpu_parts["report"].Deadline(60.0)
    call = _reference_call(kp, shift, leave_rows)
    decode = kp.run_decode_cases(ctx, deadline, call, [torch.float32], split_k=True)
    mixed = kp.run_mixed_cases(ctx, deadline, call, [torch.float32])
    for tally in (decode, mixed):
        row = tally.row("kernel")
        assert row.status == status, row
        assert why in row.note
    assert decode.total == 2  # one tiny batch, at its max_len and at a split-K max_len


def test_a_spent_budget_runs_no_case_and_says_so(gpu_parts: dict[str, ModuleType]) -> None:
    kp = _kernel_harness()
    ctx = gpu_parts["report"].Context("cpu", small=True, work_dir=Path("."))
    spent = gpu_parts["report"].Deadline(0.0)
    tally = kp.run_decode_cases(ctx, spent, _reference_call(kp), [torch.float32], split_k=False)
    assert tally.total == 0 and tally.stopped
    row = tally.row("kernel")
    assert row.status == "SKIP" and "time budget" in row.note


def test_the_cache_layout_is_the_engines(gpu_parts: dict[str, ModuleType]) -> None:
    """The harness's cache is block-major with all layers in a block, as the engine's."""
    from kvrelay.engine.kv_cache.layout import kv_block_shape
    from tests.kernels.paged_batch import make_paged_batch

    kp = _kernel_harness()
    batch = make_paged_batch([5, 9], [1, 1], 4, 2, 3, 8, num_layers=kp.NUM_LAYERS)
    fields = {"num_hidden_layers": kp.NUM_LAYERS, "num_key_value_heads": 2, "head_dim": 8}
    model = type("M", (), fields)()
    assert tuple(batch.kv_cache.shape[1:]) == kv_block_shape(model, 4)  # type: ignore[arg-type]
    assert batch.kv_cache[:, kp.LAYER].is_contiguous() is False  # a strided layer view


def test_counters_are_read_where_they_exist(gpu_parts: dict[str, ModuleType]) -> None:
    from gpu_parts import engine_models

    now = engine_models.counters()
    if now is None:
        pytest.skip("kvrelay_kernels has no counters in this checkout")
    assert set(now) <= set(engine_models.COUNTER_NAMES) and "cuda_decode_calls" in now
    later = {**now, "cuda_decode_calls": now["cuda_decode_calls"] + 3}
    assert engine_models.counter_delta(now, later)["cuda_decode_calls"] == 3
    assert engine_models.counter_delta(None, later) == {}


def test_a_decode_shape_is_timed_on_the_cpu(gpu_parts: dict[str, ModuleType]) -> None:
    bench = gpu_parts["decode"]
    shape = bench.Shape("smollm2", 9, 3, 64, 2, 64)
    result = bench.bench_shape(shape, torch.float32, "cpu", ["sdpa"], None)
    assert set(result.us) == {"sdpa"} and result.us["sdpa"] > 0 and not result.errors
    assert "smollm2" in bench.format_table([result], 10.0, 4)


def test_a_grpc_older_than_the_generated_code_makes_that_transport_n_a() -> None:
    """The GPU machine's image has its own grpcio and protobuf: when they are older than the
    generated code (kvrelay/v1) needs, its import raises a RuntimeError (grpc) or VersionError
    (protobuf), and the transfer part must say n/a for gRPC rather than fail the check."""
    probe = textwrap.dedent(f"""
        import sys
        import grpc
        grpc.__version__ = "1.60.0"  # what the generated code's own check reads
        sys.path.insert(0, {str(BENCH)!r})
        from gpu_parts.transfer_part import import_problem
        print(import_problem("grpc"))
        print(import_problem("staging"))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    grpc_problem, staging_problem = proc.stdout.strip().splitlines()[-2:]
    assert "1.60.0" in grpc_problem and "grpcio>=" in grpc_problem
    assert staging_problem == "None"
