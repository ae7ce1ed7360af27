"""Our decoder against transformers on tiny random checkpoints of every family without sliding
windows (Llama, Qwen2/3, Mistral, Phi-3; RoPE default, linear, llama3, yarn, longrope) on the
torch backend, through a paged KV cache with prefill chunks and decode tokens mixed in one
step; and the loader's errors. tests/models/test_families_vs_hf.py adds windows, Gemma and the
cpu backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.hf_checkpoints import (
    BASE,
    CASES,
    architecture_of,
    assert_mixed_steps_match_hf,
    make_checkpoint,
)

from kvrelay.config import UnsupportedModelError
from kvrelay.models import MissingWeightError, load_model
from kvrelay_kernels import select_backend

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("case", sorted(CASES))
def test_mixed_prefill_and_decode_match_hf(tmp_path: Path, case: str, paged_kv: Any) -> None:
    family, overrides = CASES[case]
    hf_model = make_checkpoint(tmp_path, family, overrides)
    model, config = load_model(tmp_path, select_backend("torch"))
    assert config.architecture == architecture_of(family)
    assert_mixed_steps_match_hf(model, hf_model, paged_kv, case)


def test_sharded_checkpoint_loads_through_index(tmp_path: Path, paged_kv: Any) -> None:
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE))
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, _ = load_model(tmp_path, select_backend("torch"))
    ids = list(range(10))
    logits = paged_kv(model, 8, 4).forward_logits(model, [("a", ids)])
    with torch.inference_mode():
        expected = hf_model.eval()(torch.tensor([ids])).logits[0]
    assert (logits - expected).abs().max().item() <= 1e-4


def test_unknown_architecture_is_rejected(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama", {})
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM"):
        load_model(tmp_path, select_backend("torch"))


def test_missing_weight_is_named(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama", {"tie_word_embeddings": False})
    path = tmp_path / "model.safetensors"
    weights = load_file(str(path))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(MissingWeightError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path, select_backend("torch"))


def test_unexpected_weight_is_reported(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama", {})
    path = tmp_path / "model.safetensors"
    weights = load_file(str(path))
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # ignored
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        load_model(tmp_path, select_backend("torch"))


def test_missing_files_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path, select_backend("torch"))
    make_checkpoint(tmp_path, "llama", {})
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path, select_backend("torch"))


def test_position_beyond_rope_table_is_rejected(tmp_path: Path, paged_kv: Any) -> None:
    make_checkpoint(tmp_path, "llama", {})
    model, _ = load_model(tmp_path, select_backend("torch"), max_positions=8)
    with pytest.raises(ValueError, match="max_positions"):
        paged_kv(model, 8, 4).forward_logits(model, [("a", list(range(9)))])
