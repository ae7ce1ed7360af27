"""prompt_logprobs in the engine: every prompt token's logprob, rank and top k equal a full
forward pass of transformers on the same checkpoint, whether the prompt is prefilled whole or
in chunks, after a prefix-cache hit, with n > 1, and across the prefill -> decode hand-off;
requests that do not ask get none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.common.messages import PromptLogprob
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from kvrelay.engine.outputs import RequestOutput
from kvrelay.worker.deltas import DeltaTracker
from tests.engine.conftest import EngineFactory, assert_pool_whole

PROMPT = [1, 17, 42, 99, 5, 63, 8, 21, 77, 3, 50, 11, 90, 31, 64, 12, 7, 88, 45, 19, 100, 6]
K = 3


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> torch.Tensor:
    """transformers' logprobs at every position of PROMPT, [P, V]."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return logits.float().log_softmax(-1)


def run(engine: Engine, params: SamplingParams, request_id: str = "r") -> RequestOutput:
    engine.add_request(request_id, PROMPT, params)
    last = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                last = output
    assert last is not None and last.finished
    return last


def assert_matches(entries: list[PromptLogprob] | None, reference: torch.Tensor, k: int) -> None:
    assert entries is not None and len(entries) == len(PROMPT) - 1
    for position, entry in enumerate(entries):
        row = reference[position]  # position p's logits score token p + 1
        token = PROMPT[position + 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry.rank == int((row > row[token]).sum()) + 1
        assert len(entry.top) == k
        top_ids = row.topk(k).indices.tolist()
        assert [t for t, _ in entry.top] == top_ids
        for (token_id, logprob), expected in zip(entry.top, row.topk(k).values, strict=True):
            assert logprob == pytest.approx(float(expected), abs=1e-4)
            assert row[token_id] == pytest.approx(float(expected), abs=1e-4)


@pytest.mark.parametrize("batched", [64, 8, 5], ids=["whole", "chunks-of-8", "chunks-of-5"])
def test_prompt_logprobs_equal_a_full_forward(
    make_engine: EngineFactory, reference: torch.Tensor, batched: int
) -> None:
    engine = make_engine(max_num_batched_tokens=batched)
    output = run(engine, SamplingParams.greedy(max_tokens=3, prompt_logprobs=K))
    assert_matches(output.prompt_logprobs, reference, K)
    assert_pool_whole(engine)


def test_zero_k_gives_the_prompt_tokens_alone(
    make_engine: EngineFactory, reference: torch.Tensor
) -> None:
    output = run(make_engine(), SamplingParams.greedy(max_tokens=2, prompt_logprobs=0))
    assert_matches(output.prompt_logprobs, reference, 0)


def test_a_request_that_does_not_ask_gets_none(make_engine: EngineFactory) -> None:
    output = run(make_engine(), SamplingParams.greedy(max_tokens=2))
    assert output.prompt_logprobs is None


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(
    make_engine: EngineFactory, reference: torch.Tensor
) -> None:
    engine = make_engine(max_num_batched_tokens=8)
    first = run(engine, SamplingParams.greedy(max_tokens=4), "warm")
    output = run(engine, SamplingParams.greedy(max_tokens=4, prompt_logprobs=K), "scored")
    assert output.metrics["num_cached_tokens"] == 0  # the cache was skipped for it
    assert_matches(output.prompt_logprobs, reference, K)
    # The same tokens as the cached run gave, and the cache serves later requests again.
    assert output.outputs[0].token_ids == first.outputs[0].token_ids
    again = run(engine, SamplingParams.greedy(max_tokens=4), "again")
    assert again.metrics["num_cached_tokens"] > 0
    assert_pool_whole(engine)


def test_n_samples_share_one_scored_prefill(
    make_engine: EngineFactory, reference: torch.Tensor
) -> None:
    engine = make_engine(max_num_batched_tokens=8)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=3, prompt_logprobs=2)
    output = run(engine, params)
    assert len(output.outputs) == 3
    assert_matches(output.prompt_logprobs, reference, 2)
    assert_pool_whole(engine)


def test_preempted_mid_prefill_scores_each_token_once(
    make_engine: EngineFactory, reference: torch.Tensor
) -> None:
    engine = make_engine(max_num_batched_tokens=8)
    params = SamplingParams.greedy(max_tokens=3, prompt_logprobs=1)
    engine.add_request("r", PROMPT, params)
    engine.step()  # the first chunk of 8 is scored
    [request] = engine.scheduler.running
    assert len(request.prompt_logprobs) == 8
    engine.scheduler._preempt(request)  # recomputed from the start, the cache up to 8 reused
    engine.add_request("other", PROMPT, SamplingParams.greedy(max_tokens=1))
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        last.update((out.request_id, out) for out in engine.step())
    assert_matches(last["r"].prompt_logprobs, reference, 1)
    assert last["other"].prompt_logprobs is None
    assert_pool_whole(engine)


def test_the_prefill_engine_sends_them_with_the_first_token(
    make_engine: EngineFactory, reference: torch.Tensor
) -> None:
    prefill = make_engine(role="prefill", max_num_batched_tokens=8)
    params = SamplingParams.greedy(max_tokens=4, prompt_logprobs=K)
    prefill.add_request("r", PROMPT, params)
    outputs: list[RequestOutput] = []
    while not outputs or not outputs[-1].finished:
        outputs.extend(o for o in prefill.step() if o.request_id == "r")
    [last] = outputs  # one output: the first token, the handle and the prompt's logprobs
    assert last.kv_handle is not None
    delta = DeltaTracker().delta(last)
    assert_matches(delta.prompt_logprobs, reference, K)
    assert delta.samples[0].token_ids == last.outputs[0].token_ids
    assert prefill.release_kv("r")
    assert_pool_whole(prefill)


def test_deltas_carry_them_once(make_engine: EngineFactory, reference: torch.Tensor) -> None:
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams.greedy(max_tokens=4, prompt_logprobs=1))
    tracker = DeltaTracker()
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(tracker.delta(o) for o in engine.step())
    assert len(deltas) == 4
    assert_matches(deltas[0].prompt_logprobs, reference, 1)
    assert all(d.prompt_logprobs is None for d in deltas[1:])


def test_out_of_range_k_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
