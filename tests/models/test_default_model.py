"""The embedded default model: the GGUF conversion against transformers' own GGUF reader, the
tokenizer, and our decoder's logits against HF's on the converted folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kvrelay.config import ModelConfig
from kvrelay.models import load_model, load_tokenizer, pull_default_model
from kvrelay.models.default_model import SOURCE_GGUF
from kvrelay_kernels import select_backend

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    # Cached after the first run: later sessions only check that the files are there.
    return pull_default_model(progress=False)


def test_config_matches_the_published_model(model_dir: Path) -> None:
    config = ModelConfig.from_pretrained(model_dir)
    assert config.architecture == "LlamaForCausalLM"
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.intermediate_size == 1536
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    assert config.rope_theta == 100000.0
    assert config.max_position_embeddings == 8192
    # <|im_end|> ends a chat turn; <|endoftext|> ends a raw completion.
    assert config.eos_token_ids == (2, 0)
    assert config.bos_token_id == 1


def test_weights_and_config_equal_transformers_gguf_import(model_dir: Path) -> None:
    # transformers' own GGUF reader (names, dequantization, q/k un-permutation) is the reference.
    # `from_pretrained(gguf_file=...)` would need `accelerate`; this is the function it calls.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours_config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        # Only used for its parameter names, which the GGUF name mapping is derived from.
        skeleton = transformers.LlamaForCausalLM(ours_config)
    parsed = load_gguf_checkpoint(
        str(model_dir / SOURCE_GGUF), return_tensors=True, model_to_load=skeleton
    )
    hf_config = parsed["config"]
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
    ):
        assert getattr(ours_config, key) == hf_config[key], key
    assert ours_config.rms_norm_eps == pytest.approx(hf_config["rms_norm_eps"], rel=1e-6)
    assert ours_config.rope_parameters["rope_theta"] == hf_config["rope_theta"]

    hf = parsed["tensors"]
    ours = load_file(str(model_dir / "model.safetensors"))
    # Tied embeddings: neither side stores lm_head.weight.
    assert set(ours) == set(hf)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == hf[name].shape, name
        diff = (tensor - hf[name]).abs().max().item()
        assert diff <= 1e-6, f"{name}: max abs diff {diff}"


def test_tokenizer_round_trips_and_has_the_chat_template(model_dir: Path) -> None:
    tokenizer = load_tokenizer(model_dir)
    text = "Hello, world! Disaggregated serving: prefill here, decode there. 1234 ünïcödé"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tokenizer.chat_template
    chat = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in chat


def test_logits_and_greedy_tokens_match_hf(model_dir: Path, paged_kv: Any) -> None:
    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer.apply_chat_template(PROMPT, tokenize=True, add_generation_prompt=True)
    if not isinstance(prompt, list):  # transformers 5 returns a BatchEncoding
        prompt = prompt["input_ids"]
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model, _ = load_model(model_dir, select_backend("torch"))

    kv = paged_kv(model, num_blocks=16, block_size=16, seed=3)
    # Prefill in two chunks, then greedy decode through the paged cache.
    split = len(prompt) // 2
    kv.forward_logits(model, [("s", prompt[:split])])
    ours = [kv.forward_logits(model, [("s", prompt[split:])])[-1]]
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(int(ours[-1].argmax()))
        ours.append(kv.forward_logits(model, [("s", tokens[-1:])])[-1])
    # One HF forward over the same tokens gives the reference logits of every step.
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0, len(prompt) - 1 :]
    got = torch.stack(ours)
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-4, f"max abs diff {diff}"
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    assert "Paris" in tokenizer.decode(tokens[len(prompt) :])
