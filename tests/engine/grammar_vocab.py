"""A real Hugging Face tokenizer for the tiny random Llama (vocabulary 128), so structured
outputs run on it as on a real model: byte-level BPE over printable ASCII (ids 3-97) plus a
few JSON-shaped merges, `</s>` (id 2, the model's EOS) as EOS. Written into a copy of the
model folder, where the engine's grammar compiler finds it as it finds a real model's."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

SPECIALS = ("<unk>", "<s>", "</s>")
EOS = 2
# Merges, in order (a merge may use an earlier one's result).
MERGES = (
    ("{", '"'),
    ('"', ":"),
    ('"', ","),
    ('"', "}"),
    ("t", "r"),
    ("tr", "u"),
    ("tru", "e"),
    ("n", "a"),
    ("na", "m"),
    ("nam", "e"),
    ("e", "s"),
    ("y", "es"),
    ("n", "o"),
    ("1", "2"),
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes as themselves, the rest shifted."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars = list(kept)
    shifted = 0
    for byte in range(256):
        if byte not in kept:
            kept.append(byte)
            chars.append(256 + shifted)
            shifted += 1
    return {byte: chr(char) for byte, char in zip(kept, chars, strict=True)}


def write_tokenizer(folder: Path) -> None:
    """Save the tokenizer (tokenizer.json, tokenizer_config.json) into `folder`."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = _bytes_to_unicode()
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for byte in range(32, 127):
        vocab[alphabet[byte]] = len(vocab)
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    assert len(vocab) <= 128
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES), unk_token="<unk>"))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)


def with_tokenizer(model_dir: Path, folder: Path) -> Path:
    """A copy of `model_dir` in `folder`, with the tokenizer written in."""
    shutil.copytree(model_dir, folder, dirs_exist_ok=True)
    write_tokenizer(folder)
    return folder


def decode(folder: Path, token_ids: list[int]) -> str:
    from kvrelay.models.tokenizer import load_tokenizer

    text: str = load_tokenizer(folder).decode(token_ids, skip_special_tokens=True)
    return text


def allowed_tokens(matcher: Any, vocab: int) -> set[int]:
    """The tokens `matcher` allows next (its bitmask read back bit by bit)."""
    import llguidance.torch as llt

    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    llt.fill_next_token_bitmask(matcher, bitmask, 0)
    words = bitmask[0].tolist()
    return {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}
