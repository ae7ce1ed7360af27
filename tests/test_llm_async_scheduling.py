"""The offline API with async scheduling forced on (the CPU default is off): the default
model's outputs, stop strings, EOS, streaming and n = 2 equal the synchronous engine's, text
and tokens, and the KV pool is whole after each (engine/async_step.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrelay import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The three primary colors are",
    "Write a haiku about the sea:",
    "List the planets of the solar system, one per line:",
    "Q: What is 12 times 12?\nA:",
]


@pytest.fixture(scope="module")
def pair(default_model_dir: Path) -> Iterator[tuple[LLM, LLM]]:
    """The same engine twice: synchronous, and with async scheduling forced on."""
    args = {"max_num_batched_tokens": 32, "kv_cache_memory": "64MiB"}
    sync = LLM(str(default_model_dir), async_scheduling=False, **args)
    overlapped = LLM(str(default_model_dir), async_scheduling=True, **args)
    assert sync.engine.overlap is None and overlapped.engine.overlap is not None
    yield sync, overlapped
    for llm in (sync, overlapped):
        llm.engine.kv_cache.pool.check_invariants()
        assert llm.engine.kv_cache.pool.is_whole(), "KV blocks leaked"


def _same(pair: tuple[LLM, LLM], params: list[SamplingParams]) -> list[list[str]]:
    """Generate on both; assert equal tokens, text and finish reasons; the texts."""
    results = [llm.generate(PROMPTS, params, use_tqdm=False) for llm in pair]
    for a, b in zip(*results, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
        assert [o.stop_reason for o in a.outputs] == [o.stop_reason for o in b.outputs]
    for llm in pair:
        assert llm.engine.kv_cache.pool.is_whole()
    return [[o.text for o in out.outputs] for out in results[1]]


def test_greedy_and_seeded_with_eos_and_max_tokens(pair: tuple[LLM, LLM]) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.8, seed=7, max_tokens=30),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=1, top_p=0.9, max_tokens=40),
    ]
    _same(pair, params)


def test_stop_strings_end_mid_batch_with_nothing_past_them(pair: tuple[LLM, LLM]) -> None:
    """Stop strings several requests reach at different steps: each text ends before its
    stop string, and no later token is emitted."""
    stops = [" ", "\n", "e", "4"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[s]) for s in stops]
    texts = _same(pair, params)
    for (text,), stop in zip(texts, stops, strict=True):
        assert stop not in text


def test_n2_samples(pair: tuple[LLM, LLM]) -> None:
    params = [SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=12)] * len(PROMPTS)
    texts = _same(pair, params)
    assert all(len(t) == 2 for t in texts)


def test_streaming_yields_the_same_text(pair: tuple[LLM, LLM]) -> None:
    prompt = "Write a haiku about the sea:"
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=["."])
    streams = ["".join(llm.stream(prompt, params)) for llm in pair]
    whole = pair[0].generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert streams[1] == streams[0] == whole


def test_a_stream_closed_early_aborts_and_frees_its_blocks(pair: tuple[LLM, LLM]) -> None:
    llm = pair[1]
    stream = llm.stream("Tell me a long story:", SamplingParams(temperature=0.0, max_tokens=60))
    next(stream)
    next(stream)
    stream.close()  # type: ignore[attr-defined]  # a generator
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.pool.is_whole()
