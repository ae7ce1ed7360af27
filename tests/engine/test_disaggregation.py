"""Prefill and decode roles on two engines in one process: the KV moves by a tensor copy here
(the real connectors are tested in tests/transfer); outputs, leases, fallbacks, no leaks."""

from __future__ import annotations

import random

import pytest

from kvrelay.common.messages import KVHandle, PullPlan
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from kvrelay.engine.outputs import RequestOutput
from tests.engine.conftest import TINY_VOCAB, EngineFactory, assert_pool_whole, run_to_completion


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)


def prefill(
    engine: Engine, prompts: dict[str, list[int]], params: SamplingParams
) -> dict[str, KVHandle]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    handles: dict[str, KVHandle] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished and out.kv_handle is not None
            assert out.outputs[0].finish_reason is None  # it goes on elsewhere
            assert out.outputs[0].token_ids == [out.kv_handle.first_token_id]
            handles[out.request_id] = out.kv_handle
    return handles


def copy_blocks(src: Engine, dst: Engine, plan: PullPlan) -> None:
    for remote, local in zip(plan.remote_block_ids, plan.local_block_ids, strict=True):
        dst.kv_tensor[local] = src.kv_tensor[remote]


def decode_all(engine: Engine) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def prompts(count: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"r{i}": [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 30))]
        for i in range(count)
    }


@pytest.fixture
def pair(make_engine: EngineFactory) -> tuple[Engine, Engine]:
    return make_engine(role="prefill"), make_engine(role="decode")


def test_prefill_then_pull_then_decode_equals_colocated(
    pair: tuple[Engine, Engine], make_engine: EngineFactory
) -> None:
    pre, dec = pair
    batch = prompts(5)
    handles = prefill(pre, batch, greedy(10))
    assert pre.stats().num_leases == 5
    for rid, prompt in batch.items():
        plan = dec.add_prefilled_request(rid, prompt, greedy(10), handles[rid])
        assert plan is not None and plan.remote_block_ids == handles[rid].block_ids
        copy_blocks(pre, dec, plan)
        dec.finish_pull(rid, ok=True)
        assert pre.release_kv(rid)
    outputs = decode_all(dec)
    colocated = make_engine()
    for rid, prompt in batch.items():
        colocated.add_request(rid, prompt, greedy(10))
    expected = run_to_completion(colocated)
    for rid in batch:
        assert outputs[rid].outputs[0].token_ids == expected[rid][0], rid
    assert dec.stats().kv_pull_fallbacks == 0
    for engine in (pre, dec, colocated):
        assert_pool_whole(engine)
    assert pre.stats().num_leases == 0


def test_decode_pulls_only_blocks_missing_from_its_prefix_cache(
    pair: tuple[Engine, Engine],
) -> None:
    pre, dec = pair
    shared = list(range(3, 15))  # three full blocks of 4
    dec.add_request("warm", [*shared, 40], greedy(1))
    run_to_completion(dec)
    handles = prefill(pre, {"a": [*shared, 50, 51]}, greedy(4))
    plan = dec.add_prefilled_request("a", [*shared, 50, 51], greedy(4), handles["a"])
    assert plan is not None
    assert plan.remote_block_ids == handles["a"].block_ids[3:]  # the 3 shared blocks are local
    copy_blocks(pre, dec, plan)
    dec.finish_pull("a", ok=True)
    assert dec.stats().kv_bytes_pulled == len(plan.local_block_ids) * dec.kv_block_bytes
    pre.release_kv("a")
    decode_all(dec)
    assert_pool_whole(dec)


def test_failed_pull_recomputes_and_gives_the_same_output(
    pair: tuple[Engine, Engine], make_engine: EngineFactory
) -> None:
    pre, dec = pair
    prompt = list(range(5, 25))
    handles = prefill(pre, {"a": prompt}, greedy(8))
    plan = dec.add_prefilled_request("a", prompt, greedy(8), handles["a"])
    assert plan is not None
    dec.finish_pull("a", ok=False)  # nothing was copied
    pre.release_kv("a")
    out = decode_all(dec)["a"]
    colocated = make_engine()
    colocated.add_request("a", prompt, greedy(8))
    assert out.outputs[0].token_ids == run_to_completion(colocated)["a"][0]
    assert dec.stats().kv_pull_fallbacks == 1
    assert_pool_whole(dec)
    assert_pool_whole(pre)


def test_mismatched_handle_is_never_read(pair: tuple[Engine, Engine]) -> None:
    pre, dec = pair
    handles = prefill(pre, {"a": list(range(5, 14))}, greedy(3))
    other_prompt = list(range(6, 15))
    assert dec.add_prefilled_request("a", other_prompt, greedy(3), handles["a"]) is None
    assert dec.stats().kv_pull_fallbacks == 1
    decode_all(dec)
    pre.release_kv("a")
    assert_pool_whole(dec)
    assert_pool_whole(pre)


def test_lease_expiry_frees_the_prefill_blocks(make_engine: EngineFactory) -> None:
    pre = make_engine(role="prefill")
    prefill(pre, {"a": list(range(5, 30))}, greedy(3))
    assert pre.kv_cache.num_free_blocks < pre.num_blocks
    assert pre.expire_leases(now=0.0) == []
    import time

    assert pre.expire_leases(now=time.monotonic() + 31) == ["a"]
    assert not pre.release_kv("a")  # already gone
    assert pre.stats().kv_leases_expired == 1
    assert_pool_whole(pre)


def test_abort_while_pulling_frees_everything(pair: tuple[Engine, Engine]) -> None:
    pre, dec = pair
    handles = prefill(pre, {"a": list(range(5, 30))}, greedy(5))
    plan = dec.add_prefilled_request("a", list(range(5, 30)), greedy(5), handles["a"])
    assert plan is not None and dec.stats().num_pulling == 1
    dec.abort("a")
    dec.finish_pull("a", ok=True)  # a late completion is ignored
    pre.abort("a")  # releases the lease
    assert_pool_whole(dec)
    assert_pool_whole(pre)


def test_prefill_engine_rejects_n_above_one(make_engine: EngineFactory) -> None:
    with pytest.raises(ValueError, match="n = 1"):
        make_engine(role="prefill").add_request("a", [5, 6], SamplingParams(n=2))


def test_cached_block_hashes_summarize_the_prefix_cache(make_engine: EngineFactory) -> None:
    from kvrelay.common.block_hash import hash_token_blocks

    engine = make_engine()
    assert engine.cached_block_hashes() == []
    prompt = list(range(5, 14))  # 9 tokens: two full blocks of 4, then a partial one
    engine.add_request("a", prompt, greedy(1))
    run_to_completion(engine)
    expected = hash_token_blocks(prompt, 4, (engine.config.model,))
    assert len(expected) == 2
    assert sorted(engine.cached_block_hashes()) == sorted(expected)


def test_forgotten_blocks_are_never_hit_again(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = list(range(5, 14))
    engine.add_request("a", prompt, greedy(1))
    run_to_completion(engine)
    cached = engine.cached_block_hashes()
    assert engine.forget_cached_blocks([*cached, b"\0" * 32]) == 2  # the unknown one: not cached
    assert engine.cached_block_hashes() == []
    hits_before = engine.stats().prefix_cache_hits
    engine.add_request("b", prompt, greedy(1))
    run_to_completion(engine)
    assert engine.stats().prefix_cache_hits == hits_before  # recomputed, not read from the cache
    assert_pool_whole(engine)


@pytest.mark.parametrize("pulled", [True, False], ids=["pulled", "recomputed"])
def test_logprobs_survive_the_hand_off(
    pair: tuple[Engine, Engine], make_engine: EngineFactory, pulled: bool
) -> None:
    """One logprobs entry per output token on the decode side, the first one the prefill's,
    whether the KV was pulled or recomputed after a failed pull."""
    pre, dec = pair
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=2)
    prompt = [5, 9, 14, 3, 22, 7, 11]
    handle = prefill(pre, {"a": prompt}, params)["a"]
    assert handle.first_token_logprobs is not None
    plan = dec.add_prefilled_request("a", prompt, params, handle)
    assert plan is not None
    if pulled:
        copy_blocks(pre, dec, plan)
    dec.finish_pull("a", ok=pulled)
    pre.release_kv("a")
    sample = decode_all(dec)["a"].outputs[0]
    colocated = make_engine()
    colocated.add_request("a", prompt, params)
    expected = next(out for out in colocated_outputs(colocated) if out.finished).outputs[0]
    assert sample.token_ids == expected.token_ids
    assert sample.logprobs is not None and expected.logprobs is not None
    assert len(sample.logprobs) == len(sample.token_ids)
    assert sample.logprobs[0] == pytest.approx(dict(handle.first_token_logprobs))
    for got, want in zip(sample.logprobs, expected.logprobs, strict=True):
        assert got.keys() == want.keys()
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
    assert_pool_whole(dec)


def colocated_outputs(engine: Engine) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs
