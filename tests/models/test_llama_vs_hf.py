"""Our decoder against transformers on tiny random Llama / Qwen2 checkpoints, through a paged
KV cache with prefill chunks and decode tokens mixed in one step; and the loader's errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.hf_checkpoints import BASE, CASES, make_checkpoint

from kvrelay.config import UnsupportedModelError
from kvrelay.models import MissingWeightError, load_model
from kvrelay_kernels import select_backend

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("case", sorted(CASES))
def test_mixed_prefill_and_decode_match_hf(tmp_path: Path, case: str, paged_kv: Any) -> None:
    family, overrides = CASES[case]
    hf_model = make_checkpoint(tmp_path, family, overrides)
    model, config = load_model(tmp_path, select_backend("torch"))
    assert config.architecture == ("Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM")

    gen = torch.Generator().manual_seed(1)
    seqs = {
        "a": torch.randint(0, BASE["vocab_size"], (23,), generator=gen).tolist(),
        "b": torch.randint(0, BASE["vocab_size"], (11,), generator=gen).tolist(),
        "c": torch.randint(0, BASE["vocab_size"], (6,), generator=gen).tolist(),
    }
    with torch.inference_mode():
        reference = {s: hf_model(torch.tensor([ids])).logits[0] for s, ids in seqs.items()}

    kv = paged_kv(model, num_blocks=32, block_size=4, seed=7)
    a, b, c = seqs["a"], seqs["b"], seqs["c"]
    steps = [
        # A's first prefill chunk, B's whole prompt, C's prompt: prefill only.
        [("a", a[:13]), ("b", b[:9]), ("c", c[:4])],
        # B decodes while A prefills its second chunk (which crosses block boundaries).
        [("b", b[9:10]), ("a", a[13:22]), ("c", c[4:5])],
        # Decode only.
        [("a", a[22:23]), ("b", b[10:11]), ("c", c[5:6])],
    ]
    for step in steps:
        start = {s: kv.lens.get(s, 0) for s, _ in step}
        logits = kv.forward_logits(model, step)
        row = 0
        for seq, tokens in step:
            expected = reference[seq][start[seq] : start[seq] + len(tokens)]
            got = logits[row : row + len(tokens)]
            row += len(tokens)
            diff = (got - expected).abs().max().item()
            assert diff <= 1e-4, f"{case}: {seq} at {start[seq]}: max abs diff {diff}"
    assert logits.dtype == torch.float32


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
    config["architectures"] = ["MistralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
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
