"""Fast checks of the GGUF conversion pieces and of pull_default_model's failure handling."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.config import UnsupportedModelError
from kvrelay.models import default_model
from kvrelay.models.gguf_convert import hf_config_from_gguf, hf_tensor_name, unpermute_rotary


def _llama_cpp_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (its `permute`)."""
    shape = weights.shape
    return (
        weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


@pytest.mark.parametrize("shape", [(4 * 8, 5), (4 * 8,)])
def test_unpermute_inverts_llama_cpp_permute(shape: tuple[int, ...]) -> None:
    weights = torch.randn(shape)
    assert torch.equal(unpermute_rotary(_llama_cpp_permute(weights, 4), 4), weights)


def test_tensor_names_map_to_hf() -> None:
    assert hf_tensor_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert (
        hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


def test_non_llama_gguf_is_rejected() -> None:
    with pytest.raises(UnsupportedModelError, match="qwen3"):
        hf_config_from_gguf({"general.architecture": "qwen3"}, set())


def test_failed_download_says_what_to_do_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))

    def fail(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="network is unreachable")

    monkeypatch.setattr(default_model.subprocess, "run", fail)
    assert not default_model.is_default_model_ready()
    with pytest.raises(default_model.DefaultModelError, match="--model PATH"):
        default_model.pull_default_model(progress=False)
    models = tmp_path / "models"
    # Only the lock file remains: no partial model folder, no download folder.
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    assert not default_model.is_default_model_ready()
