"""The hand-off (engine/handoff.py) through the Engine: leases hold exactly the prompt's blocks,
a handle that does not match is never read, the failure policy recomputes or fails, and a
request failed outside a step comes out of the next `step`. Every test ends with a whole pool."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvrelay.common.messages import KVHandle
from kvrelay.engine.engine import Engine
from kvrelay.engine.request import RequestStatus
from tests.engine.conftest import EngineFactory, assert_pool_whole, run_to_completion
from tests.engine.test_disaggregation import copy_blocks, decode_all, greedy, prefill

PROMPT = list(range(3, 23))  # 20 tokens: 5 full blocks of 4


def assert_all_free(*engines: Engine) -> None:
    for engine in engines:
        assert engine.kv_cache.num_free_blocks == engine.num_blocks
        assert_pool_whole(engine)


def colocated_tokens(make_engine: EngineFactory, prompt: list[int], tokens: int) -> list[int]:
    engine = make_engine()
    engine.add_request("c", prompt, greedy(tokens))
    return run_to_completion(engine)["c"][0]


def test_a_lease_holds_exactly_the_prompt_blocks_until_released(
    make_engine: EngineFactory,
) -> None:
    pre = make_engine(role="prefill")
    prompt = list(range(5, 19))  # 14 tokens: 4 blocks, the last one partial
    handle = prefill(pre, {"a": prompt}, greedy(3))["a"]
    assert len(handle.block_ids) == 4 and len(handle.block_hashes) == 3
    assert handle.num_tokens == 14 and handle.engine_id == pre.engine_id
    assert handle.epoch == pre.epoch
    assert pre.kv_cache.block_table("a") == list(handle.block_ids)
    assert pre.kv_cache.num_free_blocks == pre.num_blocks - 4
    assert pre.stats().num_leases == 1
    with pytest.raises(ValueError, match="already in use"):
        pre.add_request("a", prompt, greedy(3))  # the id is leased
    assert pre.release_kv("a")
    assert not pre.release_kv("a")
    assert pre.stats().num_leases == 0
    assert_all_free(pre)


def test_expiry_frees_only_the_leases_still_held(make_engine: EngineFactory) -> None:
    pre = make_engine(role="prefill")
    handles = prefill(pre, {"a": PROMPT, "b": list(range(40, 49))}, greedy(2))
    assert pre.release_kv("a")
    assert pre.kv_cache.block_table("b") == list(handles["b"].block_ids)
    assert pre.expire_leases(now=time.monotonic()) == []  # not yet
    assert pre.expire_leases(now=time.monotonic() + pre.config.kv_lease_seconds + 1) == ["b"]
    stats = pre.stats()
    assert stats.kv_leases_expired == 1 and stats.num_leases == 0
    assert not pre.release_kv("b")
    assert_all_free(pre)


def mismatched(kind: str, handle: KVHandle) -> tuple[list[int], KVHandle, str]:
    """A decode-side prompt and handle that do not fit together, and the reason's text."""
    if kind == "tokens":
        return PROMPT[:-1], handle, "handle holds 20 tokens, the prompt has 19"
    if kind == "blocks":
        return PROMPT, dataclasses.replace(handle, block_ids=handle.block_ids[:-1]), "4 blocks"
    other = [*PROMPT[:-1], PROMPT[-1] + 1]  # same length, the last full block differs
    return other, handle, "block hashes differ"


@pytest.mark.parametrize("kind", ["tokens", "blocks", "hashes"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_mismatched_handle_recomputes_or_fails(
    make_engine: EngineFactory, kind: str, policy: str
) -> None:
    pre = make_engine(role="prefill")
    dec = make_engine(role="decode", kv_transfer_failure=policy)
    prompt, handle, reason = mismatched(kind, prefill(pre, {"r": PROMPT}, greedy(5))["r"])
    assert dec.add_prefilled_request("r", prompt, greedy(5), handle) is None
    assert dec.stats().num_pulling == 0
    [sample] = decode_all(dec)["r"].outputs
    stats = dec.stats()
    if policy == "recompute":
        assert sample.finish_reason == "length" and len(sample.token_ids) == 5
        assert sample.token_ids[0] == handle.first_token_id
        assert (stats.kv_pull_fallbacks, stats.kv_transfer_failures) == (1, 0)
    else:
        assert sample.finish_reason == "abort" and sample.token_ids == [handle.first_token_id]
        assert isinstance(sample.stop_reason, str) and reason in sample.stop_reason
        assert (stats.kv_pull_fallbacks, stats.kv_transfer_failures) == (0, 1)
    assert pre.release_kv("r")
    assert_all_free(pre, dec)


def test_a_failed_pull_recomputes_the_colocated_greedy_tokens(make_engine: EngineFactory) -> None:
    """Half the blocks arrived before the pull failed: none of them is trusted or cached."""
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    handle = prefill(pre, {"r": PROMPT}, greedy(8))["r"]
    plan = dec.add_prefilled_request("r", PROMPT, greedy(8), handle)
    assert plan is not None and plan.num_blocks == 5
    half = dataclasses.replace(
        plan, remote_block_ids=plan.remote_block_ids[:2], local_block_ids=plan.local_block_ids[:2]
    )
    copy_blocks(pre, dec, half)
    dec.kv_tensor[list(plan.local_block_ids[2:])] = 1e3  # garbage in the rest
    dec.finish_pull("r", ok=False)
    assert dec.cached_block_hashes() == []
    assert pre.release_kv("r")
    expected = colocated_tokens(make_engine, PROMPT, 8)
    assert decode_all(dec)["r"].outputs[0].token_ids == expected
    stats = dec.stats()
    assert stats.kv_pull_fallbacks == 1 and stats.kv_bytes_pulled == 0
    assert_all_free(pre, dec)


def test_abort_while_waiting_for_remote_kv_frees_everything(make_engine: EngineFactory) -> None:
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    handle = prefill(pre, {"r": PROMPT}, greedy(5))["r"]
    plan = dec.add_prefilled_request("r", PROMPT, greedy(5), handle)
    assert plan is not None
    [request] = dec.scheduler.waiting_for_remote_kv.values()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not dec.has_work() and dec.step() == []  # it waits for finish_pull, not a step
    assert dec.kv_cache.num_free_blocks == dec.num_blocks - 5
    output = dec.abort("r")
    assert output is not None and output.finished
    assert output.outputs[0].finish_reason == "abort"
    assert not dec.scheduler.waiting_for_remote_kv and dec.stats().num_pulling == 0
    dec.finish_pull("r", ok=True)  # a late completion changes nothing
    assert dec.step() == [] and dec.stats().kv_bytes_pulled == 0
    assert pre.release_kv("r")
    assert_all_free(pre, dec)


def test_a_failure_outside_a_step_comes_out_of_the_next_step(make_engine: EngineFactory) -> None:
    pre = make_engine(role="prefill")
    dec = make_engine(role="decode", kv_transfer_failure="fail")
    handle = prefill(pre, {"r": PROMPT}, greedy(5))["r"]
    plan = dec.add_prefilled_request("r", PROMPT, greedy(5), handle)
    assert plan is not None and not dec.has_work()
    dec.finish_pull("r", ok=False)
    assert dec.has_work() and dec.has_unfinished_requests()
    [output] = dec.step()  # nothing else to run
    assert output.request_id == "r" and output.finished
    assert output.outputs[0].finish_reason == "abort"
    assert not dec.has_work() and not dec.has_unfinished_requests()
    assert dec.step() == []  # returned once
    assert pre.release_kv("r")
    assert_all_free(pre, dec)


def test_a_request_the_first_token_finishes_comes_out_of_the_next_step(
    make_engine: EngineFactory,
) -> None:
    """The prefill's token is the whole answer here (max_tokens=1 on the decode side; a stop
    string, which only a decode engine with a tokenizer sees, ends it the same way)."""
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    handle = prefill(pre, {"r": PROMPT}, greedy(3))["r"]
    assert dec.add_prefilled_request("r", PROMPT, greedy(1), handle) is None
    assert dec.has_work()
    [output] = dec.step()
    assert output.finished and output.outputs[0].finish_reason == "length"
    assert output.outputs[0].token_ids == [handle.first_token_id]
    assert dec.stats().kv_pull_fallbacks == 0
    assert pre.release_kv("r")
    assert_all_free(pre, dec)


def test_a_failed_request_aborted_before_the_step_is_returned_once(
    make_engine: EngineFactory,
) -> None:
    pre = make_engine(role="prefill")
    dec = make_engine(role="decode", kv_transfer_failure="fail")
    handle = prefill(pre, {"r": PROMPT}, greedy(5))["r"]
    assert dec.add_prefilled_request("r", PROMPT[:-1], greedy(5), handle) is None
    output = dec.abort("r")  # the caller gives up first: this is its final output
    assert output is not None and output.outputs[0].finish_reason == "abort"
    assert not dec.has_work() and dec.step() == []
    assert pre.release_kv("r")
    assert_all_free(pre, dec)


def test_roles_reject_what_they_cannot_hand_off(make_engine: EngineFactory) -> None:
    pre = make_engine(role="prefill")
    handle = prefill(pre, {"r": PROMPT}, greedy(3))["r"]
    with pytest.raises(ValueError, match="does not take prefilled requests"):
        pre.add_prefilled_request("x", PROMPT, greedy(3), handle)
    dec = make_engine(role="decode")
    with pytest.raises(ValueError, match="n = 1"):
        dec.add_prefilled_request("x", PROMPT, dataclasses.replace(greedy(3), n=2), handle)
    assert pre.release_kv("r")
    assert_all_free(pre, dec)


def test_a_handle_is_an_unguessable_single_use_capability(make_engine: EngineFactory) -> None:
    """What the KV server asks the hand-off (claim_pull): the lease's own blocks, once, by the
    bound decode engine, before expiry; a refusal spends nothing."""
    pre = make_engine(role="prefill")
    handles = prefill(pre, {"a": PROMPT, "b": list(range(40, 49)), "c": [7] * 9}, greedy(2))
    a, b, c = handles["a"], handles["b"], handles["c"]
    assert len({a.handle_id, b.handle_id, c.handle_id}) == 3
    assert all(len(h.handle_id) >= 32 for h in (a, b, c))  # 192 random bits, url-safe
    assert a.handle_id not in repr(a)  # a capability stays out of logs
    handoff = pre.handoff
    assert handoff.bind_handle(a.handle_id, "D1")
    assert not handoff.bind_handle(a.handle_id, "D2")  # a binding never changes
    assert not handoff.bind_handle("guess", "D1")
    blocks = list(a.block_ids)
    assert not handoff.claim_pull(a.handle_id, "D2", blocks)  # another engine's handle
    assert not handoff.claim_pull(a.handle_id, "D1", [*blocks, b.block_ids[0]])  # b's block
    assert not handoff.claim_pull("guess", "D1", blocks)
    assert handoff.claim_pull(a.handle_id, "D1", blocks[1:])  # a prefix-cached head skipped
    assert not handoff.claim_pull(a.handle_id, "D1", blocks)  # spent: a replay
    # Unbound (a router that names no decode engine): any one engine, once.
    assert handoff.claim_pull(b.handle_id, "D9", list(b.block_ids))
    assert not handoff.claim_pull(b.handle_id, "D9", list(b.block_ids))
    # Released or expired: nothing to claim. A claimed lease still holds its blocks.
    assert pre.release_kv("a") and pre.release_kv("b")
    assert not handoff.claim_pull(a.handle_id, "D1", blocks)
    assert pre.expire_leases(now=time.monotonic() + pre.config.kv_lease_seconds + 1) == ["c"]
    assert not handoff.claim_pull(c.handle_id, "D1", list(c.block_ids))
    assert_all_free(pre)
