"""The real default model with the prefix cache: greedy tokens identical with it on and off for
prompts sharing prefixes of every kind, and seeded `n` > 1 equal to separate seeded requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay import LLM, SamplingParams

pytestmark = pytest.mark.slow

BLOCK = 16
NEW_TOKENS = 12
BASE = (
    "You are a careful assistant. Answer in one short paragraph, cite no sources, and say so "
    "plainly when you do not know. The user asks about the history of clocks and calendars, "
    "from sundials and water clocks to the pendulum and the quartz crystal oscillator."
)


def shared_prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    base: list[int] = tok.encode(BASE)
    assert len(base) > 2 * BLOCK + 5 and len(base) % BLOCK != 0
    question = tok.encode(" Question: who built the first mechanical clock?")
    other = tok.encode(" Why do months have different lengths?")
    return [
        base,  # fills the cache
        base[: BLOCK + 5] + question,  # shares a prefix ending inside a block
        base[: 2 * BLOCK] + other,  # shares a prefix ending on a block boundary
        list(base),  # the whole prompt is cached
        base + question,  # the whole base plus more
        base[: 2 * BLOCK],  # a prompt of exactly two full cached blocks
    ]


def test_greedy_equal_with_cache_on_and_off(default_model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    results = {}
    for caching in (True, False):
        llm = LLM(str(default_model_dir), block_size=BLOCK, enable_prefix_caching=caching)
        tokens = []
        for prompt in shared_prompts(llm):  # one at a time: every later prompt can hit
            [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            tokens.append(out.outputs[0].token_ids)
        stats = llm.engine.stats()
        assert (stats.prefix_cache_hits > 0) == caching
        assert llm.engine.kv_cache.pool.is_whole()
        results[caching] = tokens
    assert results[True] == results[False]


def test_seeded_n_samples_equal_separate_seeded_requests(default_model_dir: Path) -> None:
    llm = LLM(str(default_model_dir), block_size=BLOCK)
    prompt = llm.get_tokenizer().encode(BASE)
    group = SamplingParams(n=4, temperature=0.9, top_p=0.95, seed=7, max_tokens=NEW_TOKENS)
    [out] = llm.generate({"prompt_token_ids": prompt}, group, use_tqdm=False)
    llm.engine.reset_prefix_cache()  # the separate requests compute their prompts themselves
    solos = llm.generate(
        [{"prompt_token_ids": prompt}] * 4,
        [
            SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=NEW_TOKENS)
            for i in range(4)
        ],
        use_tqdm=False,
    )
    assert [o.token_ids for o in out.outputs] == [s.outputs[0].token_ids for s in solos]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "samples should differ"
    assert llm.engine.kv_cache.pool.is_whole()
