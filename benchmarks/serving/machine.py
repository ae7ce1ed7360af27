"""What a serve_compare run ran on, recorded in every results file: the UTC date and time, the
git commit (and which paths were uncommitted), the CPU's model and the flags that decide the
kernels (AMX, AVX512-BF16, AVX-512, AVX2), the cores, the load average at start and end, the
project's torch, each peer's version read from the peer itself, and the exact commands.

Reads only: it never installs, starts a server or changes the tree. A fact it cannot read is
written "not recorded (why)", never guessed."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The flags that pick a CPU path: AMX tiles (oneDNN's bf16/int8 matmuls on Xeons), the
# AVX512-BF16 dot products (kvrelay's blocked kernel), AVX-512 and AVX2 (the fallbacks).
FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")
MAX_DIRTY_PATHS = 12  # listed by name; more are counted


def not_recorded(why: str) -> str:
    return f"not recorded ({why})"


@dataclass
class Machine:
    """One run's machine, code and peers (load_end and commands are filled in as it goes)."""

    date_utc: str
    commit: str
    dirty_paths: list[str]
    cpu_model: str
    cpu_family_model: str
    flags: dict[str, bool]
    cores: int
    torch: str
    peers: dict[str, str]
    load_start: str
    load_end: str = not_recorded("the run did not finish")
    ended_utc: str = not_recorded("the run did not finish")
    commands: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def run_text(command: Sequence[str], cwd: Path | None = None, timeout: float = 60) -> str:
    """A command's stdout; RuntimeError with its stderr when it fails or is missing."""
    try:
        done = subprocess.run(
            list(command), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"`{shlex.join(command)}`: {exc}") from None
    if done.returncode != 0:
        why = done.stderr.strip()[-300:]
        raise RuntimeError(f"`{shlex.join(command)}` exited {done.returncode}: {why}")
    return done.stdout


def lscpu_fields(text: str) -> dict[str, str]:
    """`lscpu`'s "Name:   value" lines as a dict."""
    fields = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip()] = value.strip()
    return fields


def cpu_flags(flags: str) -> dict[str, bool]:
    """Which of FLAGS a space-separated flag list (lscpu's "Flags", /proc/cpuinfo's) has."""
    present = set(flags.split())
    return {flag: flag in present for flag in FLAGS}


def describe_flags(flags: dict[str, bool]) -> str:
    """e.g. "avx512_bf16, avx512f, avx2; no amx_bf16, amx_tile, amx_int8"."""
    have = [f for f, on in flags.items() if on]
    lack = [f for f, on in flags.items() if not on]
    return ", ".join(have or ["none of " + "/".join(FLAGS)]) + (
        "; no " + ", ".join(lack) if lack and have else ""
    )


def git_state(repo: Path) -> tuple[str, list[str]]:
    """HEAD's full hash and the paths `git status` reports as changed or untracked (the tree is
    shared: which files were dirty says whether the measured code was the commit's)."""
    commit = run_text(["git", "rev-parse", "HEAD"], cwd=repo).strip()
    status = run_text(["git", "status", "--porcelain", "--untracked-files=normal"], cwd=repo)
    return commit, [line[3:] for line in status.splitlines() if line.strip()]


def dist_version(python: Path, dist: str) -> str:
    """The version of distribution `dist` installed for `python` (a peer's venv), as that
    Python's importlib.metadata reports it."""
    ask = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    try:
        return run_text([str(python), "-c", ask, dist]).strip()
    except RuntimeError as exc:
        return not_recorded(f"{dist} in {python}: {str(exc).splitlines()[-1][-120:]}")


def llama_server_version(binary: Path) -> str:
    """llama-server's build line (`--version` prints "version: N (hash)" to stderr)."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return not_recorded(f"{binary}: {exc}")
    lines = (done.stdout + done.stderr).splitlines()
    build = [line.strip() for line in lines if line.startswith("version:")]
    return build[0] if build else not_recorded(f"{binary} --version printed no version line")


def load_average(path: Path = Path("/proc/loadavg")) -> str:
    """The 1, 5 and 15 minute load averages, e.g. "0.69 1.31 1.52"."""
    try:
        return " ".join(path.read_text().split()[:3])
    except OSError as exc:
        return not_recorded(str(exc))


def utc_now(clock: float | None = None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(clock))


def collect(repo: Path, peers: dict[str, str], lscpu: str | None = None) -> Machine:
    """This machine now; `peers` maps each peer's name to its version (read by the caller from
    the peer itself); `lscpu` is lscpu's output (read here when not given)."""
    try:
        fields = lscpu_fields(lscpu if lscpu is not None else run_text(["lscpu"]))
    except RuntimeError as exc:
        fields = {"Model name": not_recorded(str(exc))}
    try:
        commit, dirty = git_state(repo)
    except RuntimeError as exc:
        commit, dirty = not_recorded(str(exc)), []
    family_model = (
        f"family {fields['CPU family']}, model {fields['Model']}"
        if "CPU family" in fields and "Model" in fields
        else not_recorded("lscpu printed no CPU family / Model")
    )
    return Machine(
        date_utc=utc_now(),
        commit=commit,
        dirty_paths=dirty,
        cpu_model=fields.get("Model name", not_recorded("lscpu printed no Model name")),
        cpu_family_model=family_model,
        flags=cpu_flags(fields.get("Flags", "")),
        cores=os.cpu_count() or 0,
        torch=_torch_version(),
        peers=peers,
        load_start=load_average(),
    )


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return not_recorded("torch is not installed for this Python")


def _dirty(paths: list[str]) -> str:
    if not paths:
        return "clean"
    shown = ", ".join(f"`{p}`" for p in paths[:MAX_DIRTY_PATHS])
    more = len(paths) - MAX_DIRTY_PATHS
    return f"dirty: {shown}" + (f" and {more} more" if more > 0 else "")


def header(machine: Machine) -> str:
    """The Markdown table every results file opens with (the other dated files' header)."""
    peers = "; ".join(f"{name} {version}" for name, version in machine.peers.items())
    rows = [
        ("date", f"{machine.date_utc}, ended {machine.ended_utc}"),
        ("commit", f"{machine.commit} ({_dirty(machine.dirty_paths)})"),
        ("CPU", f"{machine.cpu_model} ({machine.cpu_family_model}), {machine.cores} cores"),
        ("CPU flags", describe_flags(machine.flags)),
        ("load average (1/5/15 min)", f"start {machine.load_start}; end {machine.load_end}"),
        ("torch (kvrelay)", machine.torch),
        ("peers", peers or "none"),
    ]
    lines = ["| | |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def finish(machine: Machine) -> None:
    """The run is over: its end time and the load then."""
    machine.ended_utc = utc_now()
    machine.load_end = load_average()


def command_line(command: Sequence[str], env: dict[str, str]) -> str:
    """`command` as a shell line, led by the environment it was given; an API key's value is
    not written (a fresh random one each run)."""
    shown = [
        f"{name}=<random key>" if name.endswith("API_KEY") else f"{name}={shlex.quote(value)}"
        for name, value in sorted(env.items())
    ]
    return " ".join([*shown, shlex.join(command)])


def commands_section(machine: Machine) -> str:
    """The exact commands, one per line, in a fenced block."""
    return "Commands, in order:\n\n```\n" + "\n".join(machine.commands) + "\n```"
