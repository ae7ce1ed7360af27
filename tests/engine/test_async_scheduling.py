"""Async scheduling on the CPU with real compute (engine/async_step.py): the engine that
launches step n+1 before reading step n's tokens gives, token for token, what the
synchronous engine gives, never emits a token past a stop, and leaves every block free."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from tests.engine.conftest import EngineFactory, assert_pool_whole, run_to_completion

PROMPTS = {f"r{i}": [3 + (7 * i + j) % 120 for j in range(4 + 5 * i)] for i in range(6)}


def _finals(
    engine: Engine, max_steps: int = 2000, seen: dict[str, list[int]] | None = None
) -> dict[str, list[list[int]]]:
    """Step (step_delta) until idle (or `max_steps`), collecting each request's final token
    ids per sample, and checking that the streamed rows and outputs add up to them. `seen`:
    what the caller streamed so far, by request id (updated)."""
    streamed = {} if seen is None else seen
    done: dict[str, list[list[int]]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests() and not engine.has_work():
            assert_pool_whole(engine)
            return done
        rows_ids, rows_tokens, outputs = engine.step_delta()
        for rid, token in zip(rows_ids, rows_tokens, strict=True):
            streamed[rid].append(token)
        for out in outputs:
            streamed[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                assert out.request_id not in done, "a final output twice"
                done[out.request_id] = [list(o.token_ids) for o in out.outputs]
                assert streamed[out.request_id] == done[out.request_id][0]
    if seen is not None:
        return done
    raise AssertionError("engine did not finish")


def _both(make_engine: EngineFactory, add: Any, **knobs: Any) -> tuple[Any, Any]:
    results = []
    for flag in (False, True):
        engine = make_engine(async_scheduling=flag, **knobs)
        assert (engine.overlap is not None) is flag
        add(engine)
        results.append(_finals(engine))
    return results[0], results[1]


def _mixed(engine: Engine) -> None:
    """Greedy to max_tokens, stop tokens that end some mid-batch, EOS (id 2, the tiny model's)
    honoured, seeded sampling, a one-token request."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[40, 41, 42, 43, 44]),
        SamplingParams(temperature=0.8, seed=5, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=60),  # EOS may end it
        SamplingParams(temperature=0.9, seed=11, max_tokens=25, top_k=20, top_p=0.9),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]
    for (rid, prompt), p in zip(PROMPTS.items(), params, strict=True):
        engine.add_request(rid, prompt, p)


def test_tokens_equal_the_synchronous_engine(make_engine: EngineFactory) -> None:
    sync, overlapped = _both(make_engine, _mixed)
    assert overlapped == sync
    assert len(sync) == len(PROMPTS)
    assert sync["r5"] == [[sync["r5"][0][0]]] and len(sync["r0"][0]) == 9


def _favourites(make_engine: EngineFactory, count: int = 3) -> list[int]:
    """The tokens that the most prompts sample greedily (the tiny model's favourites)."""
    probe = make_engine(async_scheduling=False)
    for rid, prompt in PROMPTS.items():
        probe.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=30))
    common: dict[int, int] = {}
    for tokens in _finals(probe).values():
        for t in set(tokens[0]):
            common[t] = common.get(t, 0) + 1
    return sorted(common, key=lambda t: -common[t])[:count]


def test_stop_tokens_that_end_requests_mid_batch_emit_nothing_after(
    make_engine: EngineFactory,
) -> None:
    """Every request stops on a token many of them sample (the tiny model's favourites):
    each ends at its first stop token, nothing after it, as without overlap."""
    stops = _favourites(make_engine)

    def add(engine: Engine) -> None:
        for rid, prompt in PROMPTS.items():
            p = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=stops)
            engine.add_request(rid, prompt, p)

    sync, overlapped = _both(make_engine, add)
    assert overlapped == sync
    stopped = [t[0] for t in sync.values() if t[0][-1] in stops]
    assert len(stopped) >= 2, "the test needs requests that stop on a token"
    for tokens in overlapped.values():
        assert not set(tokens[0][:-1]) & set(stops), "a token past a stop"


def test_n2_samples_equal(make_engine: EngineFactory) -> None:
    def add(engine: Engine) -> None:
        engine.add_request("pair", PROMPTS["r2"], SamplingParams(n=2, temperature=0.8, seed=3))
        engine.add_request("g", PROMPTS["r1"], SamplingParams(temperature=0.0, max_tokens=12))

    for caching in (True, False):
        sync, overlapped = _both(make_engine, add, enable_prefix_caching=caching)
        assert overlapped == sync and len(sync["pair"]) == 2


def test_preemption_under_a_tiny_pool_gives_the_same_tokens(make_engine: EngineFactory) -> None:
    """12 blocks of 4 tokens for six requests that need more: preempted and recomputed."""

    def add(engine: Engine) -> None:
        for rid, prompt in PROMPTS.items():
            engine.add_request(rid, prompt[:8], SamplingParams(temperature=0.0, max_tokens=20))

    engines = []
    results = []
    waits = [0]
    for flag in (False, True):
        engine = make_engine(async_scheduling=flag, num_blocks=12)
        if engine.overlap is not None:  # a victim in the step in flight: waited for
            wait = engine.overlap.wait

            def counted(wait: Any = wait) -> None:
                waits[0] += 1
                wait()

            engine.overlap.wait = counted  # type: ignore[method-assign]
        add(engine)
        results.append(_finals(engine))
        engines.append(engine)
    assert results[1] == results[0]
    assert engines[1].scheduler.num_preemptions > 0 and waits[0] > 0


def test_mixed_prefill_and_decode_steps(make_engine: EngineFactory) -> None:
    """Long prompts chunked over several steps (8 tokens a step) while others decode: a
    chunk's final sample feeds the next decode from the device tensor."""

    def add(engine: Engine) -> None:
        engine.add_request("a", PROMPTS["r0"], SamplingParams(temperature=0.0, max_tokens=30))
        engine.add_request("long", list(range(3, 60)), SamplingParams(temperature=0.0))
        engine.add_request("b", PROMPTS["r3"], SamplingParams(temperature=0.7, seed=2))

    sync, overlapped = _both(make_engine, add, max_num_batched_tokens=8)
    assert overlapped == sync


def test_a_pending_token_is_counted_once_in_flight_and_never_after(
    make_engine: EngineFactory,
) -> None:
    """After every step, exactly the requests that the step in flight samples have one
    token pending (Request.num_pending, which the scheduler counts as known), whether the
    step took its batch's counts over from the step before (a steady decode batch: no
    per-row count either way) or counted them afresh (a batch that changed: requests
    joining, finishing, aborted); at the end, none."""
    engine = make_engine(async_scheduling=True)
    _mixed(engine)
    overlap = engine.overlap
    assert overlap is not None
    seen: dict[str, Any] = {}
    took_over = counted = 0
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        if step == 6:
            engine.abort("r3")  # a request whose token is in flight leaves the batch
        engine.step_delta()
        seen.update((r.request_id, r) for r in engine.scheduler.running)
        flight = overlap.inflight
        in_flight = set() if flight is None else {id(r) for r in flight.result.requests}
        if flight is not None:
            took_over += flight.took_over
            counted += not flight.took_over
        pending = {rid: r.num_pending for rid, r in seen.items()}
        assert pending == {rid: int(id(r) in in_flight) for rid, r in seen.items()}, step
    assert not engine.has_unfinished_requests()
    assert all(r.num_pending == 0 for r in seen.values())
    assert took_over > 10 and counted > 3, (took_over, counted)


def test_aborts_mid_generation_free_every_block(make_engine: EngineFactory) -> None:
    """Requests aborted while a step that holds them is in flight: no token of theirs
    after the abort (their outputs are what was streamed: a prefix of their tokens without
    the abort; the overlapped engine is one step behind in what it hands over), the rest as
    without overlap, and the pool whole at the end."""
    reference = make_engine(async_scheduling=False)
    _mixed(reference)
    whole = _finals(reference)
    seen = []
    for flag in (False, True):
        engine = make_engine(async_scheduling=flag)
        _mixed(engine)
        streamed: dict[str, list[int]] = {}
        early = _finals(engine, 4, streamed)
        aborted = [engine.abort(rid) for rid in ("r1", "r4")]
        assert all(a is not None and a.finished for a in aborted)
        assert [streamed[rid] for rid in ("r1", "r4")] == [
            a.outputs[0].token_ids for a in aborted if a is not None
        ], "the abort's output is what was streamed: no token of it after"
        for rid, out in zip(("r1", "r4"), aborted, strict=True):
            assert out is not None and out.outputs[0].finish_reason == "abort"
            tokens = out.outputs[0].token_ids
            assert tokens == whole[rid][0][: len(tokens)]
        seen.append({**early, **_finals(engine, seen=streamed)})
    assert seen[1] == seen[0]
    assert seen[0] == {rid: t for rid, t in whole.items() if rid not in ("r1", "r4")}


def test_abort_everything_with_a_step_in_flight_returns_the_pool(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(async_scheduling=True)
    _mixed(engine)
    engine.step_delta()
    engine.step_delta()
    assert engine.overlap is not None and engine.overlap.inflight is not None
    for rid in PROMPTS:
        engine.abort(rid)
    assert engine.overlap.inflight is None
    assert_pool_whole(engine)


def test_host_bound_requests_run_synchronous_steps(make_engine: EngineFactory) -> None:
    """Penalties, logprobs, min_tokens: the steps that hold them are not overlapped, and
    their tokens (and logprobs) equal the synchronous engine's."""

    def add(engine: Engine) -> None:
        engine.add_request("plain", PROMPTS["r0"], SamplingParams(temperature=0.0, max_tokens=20))
        engine.add_request("late", PROMPTS["r1"], SamplingParams(temperature=0.0, max_tokens=8))

    launched = []
    outs = []
    for flag in (False, True):
        engine = make_engine(async_scheduling=flag)
        add(engine)
        streamed: dict[str, list[int]] = {}
        early = _finals(engine, 5, streamed)
        engine.add_request(
            "pen", PROMPTS["r2"], SamplingParams(repetition_penalty=1.5, max_tokens=6, logprobs=1)
        )
        engine.add_request("min", PROMPTS["r3"], SamplingParams(min_tokens=4, max_tokens=6))
        outs.append({**early, **_finals(engine, seen=streamed)})
        if engine.overlap is not None:
            launched.append(engine.overlap.launched)
    assert outs[1] == outs[0]
    assert 0 < launched[0] < 12  # overlapped before the host-bound ones came, not after


def test_min_tokens_overlaps_and_counts_the_token_in_flight(make_engine: EngineFactory) -> None:
    """min_tokens needs only the count of tokens generated: its steps overlap, the token in
    flight counted, so the stop tokens (the model's favourites) are refused for exactly the
    first min_tokens tokens and the tokens equal the synchronous engine's."""
    stops = _favourites(make_engine)
    minimums = dict(zip(PROMPTS, [0, 3, 5, 8, 1, 12], strict=True))

    def add(engine: Engine) -> None:
        for rid, prompt in PROMPTS.items():
            p = SamplingParams(
                temperature=0.0, max_tokens=30, min_tokens=minimums[rid], stop_token_ids=stops
            )
            engine.add_request(rid, prompt, p)

    sync = _finals(_added(make_engine(async_scheduling=False), add))
    engine = _added(make_engine(async_scheduling=True), add)
    assert _finals(engine) == sync
    assert engine.overlap is not None and engine.overlap.launched >= 10  # overlapped
    for rid, least in minimums.items():
        tokens = sync[rid][0]
        assert not set(tokens[:least]) & set(stops), f"{rid}: a stop before min_tokens"
    held = [rid for rid, m in minimums.items() if m and len(sync[rid][0]) > m]
    assert any(sync[rid][0][-1] in stops for rid in held), "no stop after min_tokens: no test"


def _added(engine: Engine, add: Any) -> Engine:
    add(engine)
    return engine


def test_the_prefill_role_refuses_async_scheduling(make_engine: EngineFactory) -> None:
    with pytest.raises(ValueError, match="prefill engine"):
        make_engine(role="prefill", async_scheduling=True)
    assert make_engine(role="prefill").overlap is None


def test_a_token_outside_the_vocabulary_fails_its_request_alone(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row whose sampling gives no valid id (NaN logits: the inverse CDF returns the
    vocabulary size) is found at the read: its request fails alone, as in the synchronous
    engine, and the next step's input, gathered before the read, is clamped into the
    vocabulary (the embedding never reads out of range)."""
    engine = make_engine(async_scheduling=True)
    sampler = engine.runner.sampler
    sample_on_device = sampler.sample_on_device
    vocab = engine.config.model_config.vocab_size
    calls = [0]

    def broken(logits: Any, rows: Any, uniforms: Any) -> Any:
        tokens, logprobs = sample_on_device(logits, rows, uniforms)
        calls[0] += 1
        if calls[0] == 4 and tokens.shape[0] == 2:  # the 4th step: row 0 goes bad
            tokens = tokens.clone()
            tokens[0] = vocab
        return tokens, logprobs

    monkeypatch.setattr(sampler, "sample_on_device", broken)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("bad", PROMPTS["r0"], params)
    engine.add_request("good", PROMPTS["r1"], params)
    outs: dict[str, Any] = {}
    while engine.has_unfinished_requests() or engine.has_work():
        for out in engine.step_delta().outputs:
            outs[out.request_id] = out
    assert outs["bad"].error is not None and outs["bad"].outputs[0].finish_reason == "abort"
    assert len(outs["bad"].outputs[0].token_ids) == 3  # the three before the bad one
    reference = make_engine(async_scheduling=False)
    reference.add_request("good", PROMPTS["r1"], params)
    assert outs["good"].outputs[0].token_ids == _finals(reference)["good"][0]
    assert_pool_whole(engine)


def test_blocks_of_a_request_finished_mid_flight_wait_for_its_step(
    make_engine: EngineFactory,
) -> None:
    """An abort while the request's next step is in flight takes it off its blocks at once
    (its id is free to use again) but gives them back to the pool only when that step is
    read; a preemption in the same position waits for the step instead (tiny-pool test
    above)."""
    engine = make_engine(async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", PROMPTS["r3"], params)
    engine.add_request("b", PROMPTS["r4"], params)
    for _ in range(3):
        engine.step_delta()
    pool, overlap = engine.kv_cache.pool, engine.overlap
    assert overlap is not None and overlap.inflight is not None
    free = pool.num_free_blocks
    blocks = list(engine.kv_cache.block_table("a"))
    engine.abort("a")
    assert engine.kv_cache.num_requests() == 1  # "a" holds nothing any more...
    assert pool.num_free_blocks == free  # ...but its blocks wait for the step in flight
    assert [block for _, held in overlap._held for block in held] == blocks
    engine.add_request("a", PROMPTS["r0"], params)  # the id is free again
    engine.step_delta()  # reads the step that used them
    assert overlap._held == []
    for rid in ("a", "b"):
        engine.abort(rid)
    assert_pool_whole(engine)


def test_the_flag_and_its_default(make_engine: EngineFactory) -> None:
    """`--async-scheduling/--no-async-scheduling` reach EngineArgs; unset, it is on for CUDA
    and off on the CPU (nothing to overlap there), and off with a log line on a prefill
    engine; asked for there, it is refused at parse time."""
    import argparse
    import dataclasses

    from kvrelay.engine.args import EngineArgs
    from kvrelay.engine.async_step import async_enabled

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    for argv, value in (([], None), (["--async-scheduling"], True),
                        (["--no-async-scheduling"], False)):  # fmt: skip
        assert EngineArgs.from_cli_args(parser.parse_args(argv)).async_scheduling is value
    with pytest.raises(ValueError, match="prefill engine"):
        EngineArgs(async_scheduling=True, role="prefill")
    config = make_engine().config
    assert config.async_scheduling is None and not async_enabled(config)
    on_cuda = dataclasses.replace(config, device="cuda:1")
    assert async_enabled(on_cuda)
    assert not async_enabled(dataclasses.replace(on_cuda, async_scheduling=False))
    assert not async_enabled(dataclasses.replace(on_cuda, role="prefill"))
    assert async_enabled(dataclasses.replace(config, async_scheduling=True))


@pytest.mark.parametrize("num_blocks", [24, 64])
def test_the_accelerator_paths_feed_the_right_tokens(
    make_engine: EngineFactory, num_blocks: int
) -> None:
    """The runner's accelerator paths on the CPU, with real values (test_decode_path.py's
    stand-ins: one staged upload, the persistent block table, a "graph" that runs the model
    on exactly the tensors a graph would read): with async scheduling, every input id that
    is fed on the device from the last step's tokens is the token the synchronous host path
    uses, through chunked prefills, forks, preemptions (24 blocks), prefix-cache hits and
    requests stopping mid-batch."""
    from tests.engine.test_decode_path import _decode_path, _requests

    reference = make_engine(num_blocks=num_blocks, max_num_batched_tokens=16)
    _requests(reference)
    expected = run_to_completion(reference)
    engine = make_engine(num_blocks=num_blocks, max_num_batched_tokens=16, async_scheduling=True)
    graphs = _decode_path(engine)
    _requests(engine)
    assert run_to_completion(engine) == expected
    assert graphs.replays > 5 and engine.overlap is not None and engine.overlap.launched > 10
    assert_pool_whole(engine)
