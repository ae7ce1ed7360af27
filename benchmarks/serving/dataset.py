"""The `random` dataset: prompts of random token ids decoded by the model's tokenizer.

Lengths follow vLLM's --random-range-ratio: each request's input (output) length is drawn
uniformly from [floor(L * (1 - r)), ceil(L * (1 + r))]. A fixed seed gives the same prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens of `prompt` under the tokenizer, without special tokens
    output_len: int  # tokens asked for (max_tokens = min_tokens, EOS ignored)


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive range a length is drawn from (at least 1 token)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def random_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[SampleRequest]:
    """`num_prompts` requests of random text; prompt lengths are re-measured after decoding
    (decode -> encode does not round-trip exactly, so the ids are cut to the target first)."""
    rng = np.random.default_rng(seed)
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    requests = []
    for _ in range(num_prompts):
        target = int(rng.integers(in_low, in_high + 1))
        ids = rng.choice(allowed, size=target).tolist()
        prompt = tokenizer.decode(ids)
        # Re-encoding may merge or split tokens; trim to the target so lengths stay honest.
        encoded = tokenizer.encode(prompt, add_special_tokens=False)
        if len(encoded) > target:
            prompt = tokenizer.decode(encoded[:target])
            encoded = tokenizer.encode(prompt, add_special_tokens=False)
        requests.append(
            SampleRequest(
                prompt=prompt,
                prompt_len=len(encoded),
                output_len=int(rng.integers(out_low, out_high + 1)),
            )
        )
    return requests
