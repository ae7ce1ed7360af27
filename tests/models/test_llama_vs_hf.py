"""Our decoder against transformers on tiny random Llama / Qwen2 checkpoints, through a paged
KV cache with prefill chunks and decode tokens mixed in one step; and the loader's errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.config import UnsupportedModelError
from kvrelay.models import MissingWeightError, load_model
from kvrelay_kernels import select_backend

transformers = pytest.importorskip("transformers")

BASE: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-tied": ("llama", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "llama-mha-untied": ("llama", {"tie_word_embeddings": False, "rope_theta": 500.0}),
    "llama3-rope-headdim-bias": (
        "llama",
        {
            # head_dim 24 != hidden / heads = 16; one KV head for all four query heads.
            "head_dim": 24,
            "num_key_value_heads": 1,
            "attention_bias": True,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            # A small original context puts the test's positions in all three llama3 bands.
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama-linear-rope": (
        "llama",
        {"num_key_value_heads": 2, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "qwen2-bias-gqa": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen2-tied": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
}


def _make_checkpoint(folder: Path, family: str, overrides: dict[str, Any]) -> Any:
    """Write a random HF checkpoint to `folder` and return the HF model (eval, fp32)."""
    torch.manual_seed(0)
    kwargs = {**BASE, **overrides}
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    # HF's init (std 0.02) gives near-zero logits that would hide a wrong layout; larger
    # weights make every part of the computation show in the output.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_mixed_prefill_and_decode_match_hf(tmp_path: Path, case: str, paged_kv: Any) -> None:
    family, overrides = CASES[case]
    hf_model = _make_checkpoint(tmp_path, family, overrides)
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
    _make_checkpoint(tmp_path, "llama", {})
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
        load_model(tmp_path, select_backend("torch"))


def test_missing_weight_is_named(tmp_path: Path) -> None:
    _make_checkpoint(tmp_path, "llama", {"tie_word_embeddings": False})
    path = tmp_path / "model.safetensors"
    weights = load_file(str(path))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(MissingWeightError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path, select_backend("torch"))


def test_unexpected_weight_is_reported(tmp_path: Path) -> None:
    _make_checkpoint(tmp_path, "llama", {})
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
    _make_checkpoint(tmp_path, "llama", {})
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path, select_backend("torch"))


def test_position_beyond_rope_table_is_rejected(tmp_path: Path, paged_kv: Any) -> None:
    _make_checkpoint(tmp_path, "llama", {})
    model, _ = load_model(tmp_path, select_backend("torch"), max_positions=8)
    with pytest.raises(ValueError, match="max_positions"):
        paged_kv(model, 8, 4).forward_logits(model, [("a", list(range(9)))])
