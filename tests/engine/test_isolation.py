"""One request can never break a batch: a request whose sampling fails is failed alone (its
blocks freed, RequestOutput.error set), and the others get exactly the tokens of a clean run."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import pytest
import torch

from kvrelay.common.messages import RequestFailedError
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from kvrelay.engine.isolation import SAMPLING_FAILED
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.sampler import Sampler, SamplingRow
from kvrelay.llm import LLM
from tests.engine.conftest import EngineFactory, assert_pool_whole

PROMPTS = {name: list(range(3 + 5 * i, 14 + 6 * i)) for i, name in enumerate("abcdef")}
# Innocent requests: greedy and seeded random (their tokens do not depend on the batch).
INNOCENT = {
    "a": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    "b": SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
    "c": SamplingParams(temperature=0.8, top_p=0.9, seed=8, n=2, max_tokens=10, ignore_eos=True),
    "d": SamplingParams(temperature=1.0, top_k=9, seed=9, max_tokens=10, repetition_penalty=1.2),
}
MARKER_TOP_K = 77  # a fault is injected into rows whose params carry this top_k


def run(
    engine: Engine,
    requests: dict[str, SamplingParams],
    tamper: Callable[[Engine], None] | None = None,
    max_steps: int = 500,
) -> dict[str, RequestOutput]:
    """Add every request, let `tamper` edit the queued ones, step until idle; each request's
    final output."""
    for rid, params in requests.items():
        engine.add_request(rid, PROMPTS[rid], params)
    if tamper is not None:
        tamper(engine)
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    raise AssertionError("engine did not finish")


def tokens(outputs: dict[str, RequestOutput]) -> dict[str, list[list[int]]]:
    return {rid: [s.token_ids for s in out.outputs] for rid, out in outputs.items()}


def assert_failed_alone(out: RequestOutput) -> None:
    assert out.finished and out.error == SAMPLING_FAILED
    assert all(s.finish_reason == "abort" for s in out.outputs)


def fail_marked_rows(monkeypatch: pytest.MonkeyPatch, after_tokens: int) -> None:
    """Make the random-sampling arithmetic raise for any batch holding a marked row that has
    generated `after_tokens` tokens: after the uniforms are drawn, as a real fault would be."""
    original = Sampler._sample

    def faulty(x: torch.Tensor, rows: Sequence[SamplingRow], u: torch.Tensor) -> torch.Tensor:
        for r in rows:
            if r.params.top_k == MARKER_TOP_K and len(r.output_token_ids) >= after_tokens:
                raise RuntimeError("injected sampling fault")
        return original(x, rows, u)

    monkeypatch.setattr(Sampler, "_sample", staticmethod(faulty))


@pytest.mark.parametrize("seeded", [True, False])
def test_injected_fault_fails_only_its_request(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, seeded: bool
) -> None:
    """The faulty request fails mid-decode (blocks held); the batched sampling raises after
    every row drew its uniform, so re-sampling rows alone must not draw again."""
    clean = tokens(run(make_engine(), INNOCENT))
    fail_marked_rows(monkeypatch, after_tokens=3)
    engine = make_engine()
    bad = SamplingParams(
        temperature=1.0, top_k=MARKER_TOP_K, seed=5 if seeded else None, max_tokens=10
    )
    outputs = run(engine, {**INNOCENT, "e": bad})
    assert_failed_alone(outputs.pop("e"))
    assert tokens(outputs) == clean
    assert all(out.error is None for out in outputs.values())
    assert_pool_whole(engine)


def test_one_failed_sample_fails_its_whole_request(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n = 2: sample 1 fails, sample 0 sampled fine that step; the request fails as a whole
    and sample 0's token is not appended."""
    clean = tokens(run(make_engine(), INNOCENT))
    original = Sampler._sample

    def faulty(x: torch.Tensor, rows: Sequence[SamplingRow], u: torch.Tensor) -> torch.Tensor:
        if any(r.params.seed == 101 and len(r.output_token_ids) >= 2 for r in rows):
            raise RuntimeError("injected sampling fault")
        return original(x, rows, u)

    monkeypatch.setattr(Sampler, "_sample", staticmethod(faulty))
    engine = make_engine()
    bad = SamplingParams(temperature=1.0, seed=100, n=2, max_tokens=10, ignore_eos=True)
    outputs = run(engine, {**INNOCENT, "e": bad})
    failed = outputs.pop("e")
    assert_failed_alone(failed)
    assert [len(s.token_ids) for s in failed.outputs] == [2, 2]
    assert tokens(outputs) == clean
    assert_pool_whole(engine)


def test_params_that_slip_past_validation_fail_alone(make_engine: EngineFactory) -> None:
    """A stop token id past int64 (SamplingParams refuses it; forced into the queued request
    here) made the whole step raise OverflowError; now only its request fails, at once."""

    def force_huge_stop_id(engine: Engine) -> None:
        [request] = [r for r in engine.scheduler.waiting if r.request_id == "e"]
        object.__setattr__(request.sampling_params, "stop_token_ids", (2**64,))

    clean = tokens(run(make_engine(), INNOCENT))
    engine = make_engine()
    bad = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4)
    outputs = run(engine, {**INNOCENT, "e": bad}, force_huge_stop_id)
    failed = outputs.pop("e")
    assert_failed_alone(failed)
    assert failed.outputs[0].token_ids == []
    assert tokens(outputs) == clean
    assert_pool_whole(engine)


@pytest.mark.parametrize(
    "extreme",
    [
        {"temperature": 1.0, "repetition_penalty": 1e-300},
        {"temperature": 1.0, "repetition_penalty": 1e-40},
        {"temperature": 1e300, "top_k": 5},
        {"temperature": 1e300, "repetition_penalty": 1e300, "min_tokens": 3},
    ],
)
def test_extreme_but_valid_params_are_answered(
    make_engine: EngineFactory, extreme: dict[str, float]
) -> None:
    """What vLLM accepts is answered (clamped into the sampler's fp32 range), not refused."""
    clean = tokens(run(make_engine(), INNOCENT))
    engine = make_engine()
    params = SamplingParams(max_tokens=6, seed=3, **extreme)  # type: ignore[arg-type]
    outputs = run(engine, {**INNOCENT, "e": params})
    out = outputs.pop("e")
    assert out.error is None and out.outputs[0].finish_reason in ("stop", "length")
    assert all(0 <= t < engine.config.model_config.vocab_size for t in out.outputs[0].token_ids)
    assert tokens(outputs) == clean
    assert_pool_whole(engine)


def test_offline_llm_marks_the_failed_request_and_stream_raises(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_marked_rows(monkeypatch, after_tokens=0)
    llm = LLM.__new__(LLM)  # the tiny model has no tokenizer: token-id prompts only
    llm.engine, llm.tokenizer, llm._ids = make_engine(), None, itertools.count()
    bad = SamplingParams(temperature=1.0, top_k=MARKER_TOP_K, max_tokens=4)
    good = dataclasses.replace(INNOCENT["a"], max_tokens=4)
    prompts = [{"prompt_token_ids": PROMPTS["a"]}, {"prompt_token_ids": PROMPTS["b"]}]
    ok, failed = llm.generate(prompts, [good, bad], use_tqdm=False)
    assert ok.error is None and len(ok.outputs[0].token_ids) == 4
    assert_failed_alone(failed)
    with pytest.raises(RequestFailedError, match="could not sample"):
        list(llm.stream({"prompt_token_ids": PROMPTS["b"]}, bad))
    assert_pool_whole(llm.engine)
