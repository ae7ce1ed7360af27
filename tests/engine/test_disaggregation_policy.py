"""kv_transfer_failure: "recompute" (the default) recomputes an unusable prompt KV on the
decode engine; "fail" finishes the request aborted with a clear error and frees its blocks,
its final output returned by the next `step`."""

from __future__ import annotations

import dataclasses

import pytest

from kvrelay.config import EngineConfig
from kvrelay.engine.engine import Engine
from kvrelay.engine.outputs import RequestOutput
from tests.engine.conftest import EngineFactory, assert_pool_whole
from tests.engine.test_disaggregation import decode_all, greedy, prefill

PROMPT = list(range(3, 23))


def assert_failed(output: RequestOutput, reason: str) -> None:
    assert output.finished and output.request_id == "r"
    sample = output.outputs[0]
    assert sample.finish_reason == "abort"
    assert isinstance(sample.stop_reason, str)
    assert sample.stop_reason.startswith("KV transfer failed: ")
    assert reason in sample.stop_reason
    assert "kv_transfer_failure=recompute" in sample.stop_reason


def failing_decoder(make_engine: EngineFactory, **kwargs: int) -> Engine:
    return make_engine(role="decode", kv_transfer_failure="fail", **kwargs)


def test_config_rejects_unknown_policy(make_engine: EngineFactory) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="kv_transfer_failure must be one of recompute, fail"):
        dataclasses.replace(engine.config, kv_transfer_failure="retry")
    assert EngineConfig.__dataclass_fields__["kv_transfer_failure"].default == "recompute"


def test_failed_pull_fails_the_request(make_engine: EngineFactory) -> None:
    pre, dec = make_engine(role="prefill"), failing_decoder(make_engine)
    handle = prefill(pre, {"r": PROMPT}, greedy(6))["r"]
    plan = dec.add_prefilled_request("r", PROMPT, greedy(6), handle)
    assert plan is not None and dec.stats().num_pulling == 1
    dec.finish_pull("r", ok=False)
    assert dec.has_work()  # only the failed output is pending: a loop must still step
    [output] = dec.step()
    assert_failed(output, "the KV transfer failed")
    assert dec.step() == [] and not dec.has_work()
    assert not dec.has_unfinished_requests()
    stats = dec.stats()
    assert stats.kv_transfer_failures == 1 and stats.kv_pull_fallbacks == 0
    assert stats.num_pulling == 0
    assert_pool_whole(dec)
    assert pre.release_kv("r")
    assert_pool_whole(pre)


def test_mismatched_handle_fails_the_request(make_engine: EngineFactory) -> None:
    pre, dec = make_engine(role="prefill"), failing_decoder(make_engine)
    handle = prefill(pre, {"r": PROMPT}, greedy(6))["r"]
    other = [*PROMPT[:-1], PROMPT[-1] + 1]  # same length, other tokens: hashes differ
    assert dec.add_prefilled_request("r", other, greedy(6), handle) is None
    [output] = dec.step()
    assert_failed(output, "block hashes differ")
    assert dec.stats().kv_transfer_failures == 1
    assert_pool_whole(dec)
    assert pre.release_kv("r")


def test_no_free_blocks_fails_the_request(make_engine: EngineFactory) -> None:
    pre = make_engine(role="prefill")
    dec = failing_decoder(make_engine, num_blocks=8)
    handle = prefill(pre, {"r": PROMPT}, greedy(6))["r"]
    # Hold most of the decode pool so the 5 prompt blocks do not fit.
    dec.add_request("hog", list(range(40, 60)), greedy(4))
    dec.step()
    assert dec.add_prefilled_request("r", PROMPT, greedy(6), handle) is None
    outputs = {output.request_id: output for output in dec.step()}
    assert set(outputs) == {"hog", "r"}  # the failed output comes with the batch's
    assert_failed(outputs["r"], "no free KV blocks")
    decode_all(dec)
    assert dec.stats().kv_transfer_failures == 1
    assert_pool_whole(dec)
    assert pre.release_kv("r")


def test_recompute_is_still_the_default(make_engine: EngineFactory) -> None:
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    handle = prefill(pre, {"r": PROMPT}, greedy(6))["r"]
    assert dec.add_prefilled_request("r", PROMPT, greedy(6), handle) is not None
    dec.finish_pull("r", ok=False)
    [first] = dec.step()  # recomputing, not failed
    assert not first.finished and first.outputs[0].finish_reason is None
    outputs = decode_all(dec)
    assert outputs["r"].outputs[0].finish_reason == "length"
    assert len(outputs["r"].outputs[0].token_ids) == 6
    stats = dec.stats()
    assert stats.kv_pull_fallbacks == 1 and stats.kv_transfer_failures == 0
    assert_pool_whole(dec)
    assert pre.release_kv("r")
