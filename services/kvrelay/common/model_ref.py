"""What `--model` names, resolved to a folder in one place: a local folder, or a Hugging Face
Hub id `ORG/NAME[@REVISION]` taken from the Hub cache first and downloaded otherwise.

Reads the HF cache and offline settings at call time (huggingface_hub reads them once, at its
import); never logs a token (HF_TOKEN goes to huggingface_hub untouched). No engine, no torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# The Hub's own rule for a model id: ORG/NAME of letters, digits, '-', '_' and '.', neither
# part starting or ending with '-' or '.', no '--' or '..' (huggingface_hub's validate_repo_id).
# The operator checks KVRelayService hub ids by the same rule (kvrelay_operator/spec.py).
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^{_PART}/{_PART}$")
# What kvrelay loads from a snapshot: the config, the safetensors weights (and their index),
# tokenizer files, generation defaults and chat templates. Never pickles (*.bin/*.pt/*.pth).
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
GGUF_PATTERNS = ("*.gguf",)
OTHER_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
)
_TRUE = frozenset({"1", "ON", "YES", "TRUE"})


class ModelNotFoundError(FileNotFoundError):
    """`--model` names neither a usable folder nor a Hub id that can be had."""


@dataclass(frozen=True)
class HubId:
    """`ORG/NAME` at `revision` (a branch, tag or commit; None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class ResolvedModel:
    """A model folder and, for a Hub id, the id and the commit its snapshot is."""

    path: Path
    hub_id: str | None = None
    commit: str | None = None

    @property
    def name(self) -> str:
        """The id clients see by default: the Hub id, else the folder's name."""
        return self.hub_id or self.path.name

    @property
    def pinned(self) -> str:
        """What other processes pass as `--model` to load this very snapshot: the Hub id at
        its commit (the same on every node with access to the Hub or a copied cache), else
        the folder."""
        if self.hub_id is not None and self.commit is not None:
            return f"{self.hub_id}@{self.commit}"
        return str(self.path)


def parse_model_ref(model: str) -> Path | HubId:
    """A local folder or a Hub id; which one, decided without the network (vLLM's rule: a
    path that exists is the folder, even one spelled like `ORG/NAME`).

    Raises:
        ModelNotFoundError: a path that does not exist, or neither a path nor `ORG/NAME`.
    """
    path = Path(model).expanduser()
    if path.exists():
        return path
    name, _, revision = model.partition("@")
    if _looks_like_path(name) or not _HUB_ID.match(name) or ".." in name or "--" in name:
        raise ModelNotFoundError(
            f"model {model!r} not found: pass a local Hugging Face folder (config.json, "
            "*.safetensors, tokenizer files), a Hugging Face id ORG/NAME[@REVISION], or no "
            "model for the default one"
        )
    if "@" in model and not revision:
        raise ModelNotFoundError(f"model {model!r}: name a revision after '@', or drop the '@'")
    return HubId(name, revision or None)


def _looks_like_path(model: str) -> bool:
    """`./x`, `../x`, `/abs`, `~/x`, `a/b/c` or a Windows path: never a Hub id."""
    return model.startswith((".", "/", "~")) or "\\" in model or model.count("/") != 1


def check_folder(path: Path) -> Path:
    """`path` if it holds a config.json (the rest is checked when the model loads).

    Raises:
        ModelNotFoundError: no config.json there.
    """
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"model folder {path} has no config.json: pass a Hugging Face folder (config.json, "
            "*.safetensors, tokenizer files), a Hugging Face id ORG/NAME[@REVISION], or no "
            "model for the default one"
        )
    return path


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The Hub cache folder, as huggingface_hub computes it, from the environment now."""
    env = os.environ if environ is None else environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(env.get("HF_HOME") or Path(xdg) / "huggingface").expanduser() / "hub"


def hub_offline(environ: Mapping[str, str] | None = None) -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) forbids the network, read now."""
    env = os.environ if environ is None else environ
    value = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def allow_patterns(quantization: str = "none") -> list[str]:
    """The files a snapshot download fetches: the safetensors weights, or for a GGUF
    quantization (q4_1, q8_0) the GGUF instead, or for `auto` both."""
    weights = {
        "none": WEIGHT_PATTERNS,
        "auto": WEIGHT_PATTERNS + GGUF_PATTERNS,
    }.get(quantization, GGUF_PATTERNS)
    return [*OTHER_PATTERNS, *weights]


def missing_files(folder: Path, quantization: str = "none") -> str | None:
    """What a snapshot lacks for kvrelay to load it (None: nothing)."""
    if not (folder / "config.json").is_file():
        return "config.json"
    patterns = allow_patterns(quantization)[len(OTHER_PATTERNS) :]
    if not any(any(folder.glob(p)) for p in patterns if "index" not in p):
        return " or ".join(p for p in patterns if "index" not in p) + " weights"
    return None


def resolve_model_ref(
    model: str, quantization: str = "none", environ: Mapping[str, str] | None = None
) -> ResolvedModel:
    """`model` as a folder kvrelay can load: a local folder as it is, a Hub id from the Hub
    cache when its snapshot there is complete, else downloaded (unless offline).

    Raises:
        ModelNotFoundError: as `parse_model_ref`; a folder without config.json; a Hub id that
            is not cached while offline, unknown to the Hub, gated, or unreachable.
    """
    ref = parse_model_ref(model)
    if isinstance(ref, Path):
        return ResolvedModel(check_folder(ref))
    folder = _cached_snapshot(ref, quantization, environ)
    if folder is None:
        folder = _download_snapshot(ref, quantization, environ)
    missing = missing_files(folder, quantization)
    if missing is not None:
        raise ModelNotFoundError(
            f"the Hugging Face model {ref} has no {missing} kvrelay can load (snapshot at "
            f"{folder}); kvrelay loads config.json with *.safetensors (or a GGUF with "
            "--quantization), never *.bin/*.pt pickles"
        )
    return ResolvedModel(folder, ref.repo_id, folder.name)


def _cached_snapshot(
    ref: HubId, quantization: str, environ: Mapping[str, str] | None
) -> Path | None:
    """The complete snapshot of `ref` in the Hub cache, without the network; None when absent
    or partial online (a download completes it). Offline, absent is an error saying so."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir(environ)
    offline = hub_offline(environ)
    try:
        folder = Path(
            snapshot_download(
                ref.repo_id,
                revision=ref.revision,
                cache_dir=cache,
                local_files_only=True,
                allow_patterns=allow_patterns(quantization),
            )
        )
    except (LocalEntryNotFoundError, OSError):
        folder = None
    if folder is not None and (offline or missing_files(folder, quantization) is None):
        return folder
    if offline:
        raise ModelNotFoundError(
            f"the Hugging Face model {ref} is not in the Hugging Face cache at {cache} and "
            f"HF_HUB_OFFLINE is set: fetch it online first (`hf download {ref.repo_id}"
            + (f" --revision {ref.revision}" if ref.revision else "")
            + "`, into the same HF_HUB_CACHE / HF_HOME), or unset HF_HUB_OFFLINE to download"
        )
    return None


def _download_snapshot(ref: HubId, quantization: str, environ: Mapping[str, str] | None) -> Path:
    """Download `ref`'s loadable files into the Hub cache, with huggingface_hub's progress
    bars; its token (HF_TOKEN, or a `hf auth login`) is huggingface_hub's own business."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(
            snapshot_download(
                ref.repo_id,
                revision=ref.revision,
                cache_dir=hub_cache_dir(environ),
                allow_patterns=allow_patterns(quantization),
            )
        )
    except GatedRepoError:
        reason = "is gated: accept its terms on huggingface.co and set HF_TOKEN"
    except RevisionNotFoundError:
        reason = f"has no revision {ref.revision!r}"
    except RepositoryNotFoundError:
        reason = "does not exist on the Hub, or is private (set HF_TOKEN to one that reads it)"
    except LocalEntryNotFoundError:
        reason = "is not in the Hub cache and the Hub cannot be reached (offline? proxy?)"
    except OSError as exc:  # huggingface_hub's HTTP errors (a 5xx, a full disk) are OSErrors
        reason = f"could not be downloaded: {type(exc).__name__}: {exc}"
    raise ModelNotFoundError(f"the Hugging Face model {ref} {reason}")
