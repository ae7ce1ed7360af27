"""The offline API on the real default model: generate, chat, stream, n, logprobs, bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.config import UnsupportedModelError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(default_model_dir), max_num_batched_tokens=64, kv_cache_memory="64MiB")
    yield llm
    llm.engine.kv_cache.pool.check_invariants()
    assert llm.engine.kv_cache.pool.is_whole(), "KV blocks leaked"


def greedy(tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, **kw)  # type: ignore[arg-type]


def test_chat_answers_from_the_models_template(llm: LLM) -> None:
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy(30))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> is the model's EOS
    assert out.prompt is not None and "<|im_start|>assistant" in out.prompt


def test_generate_text_and_token_prompts_agree(llm: LLM) -> None:
    text = "The three primary colors are"
    ids = llm.get_tokenizer()(text)["input_ids"]
    by_text, by_ids = llm.generate([text, {"prompt_token_ids": ids}], greedy(12), use_tqdm=False)
    assert by_text.prompt_token_ids == ids == by_ids.prompt_token_ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.get_tokenizer().decode(by_ids.outputs[0].token_ids)
    assert by_ids.prompt is None


def test_outputs_keep_prompt_order_and_per_prompt_params(llm: LLM) -> None:
    prompts = ["One", "Two two two two two two two two", "Three"]
    params = [greedy(3, ignore_eos=True), greedy(9, ignore_eos=True), greedy(1, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 1]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_stream_yields_the_same_text_as_generate(llm: LLM) -> None:
    prompt = "Write a haiku about the sea:"
    whole = llm.generate([prompt], greedy(20), use_tqdm=False)[0].outputs[0].text
    pieces = list(llm.stream(prompt, greedy(20)))
    assert len(pieces) > 3
    assert "".join(pieces) == whole


def test_stop_string_cuts_the_text(llm: LLM) -> None:
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    full = llm.generate([prompt], greedy(12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = full.text.strip()[:2]
    out = llm.generate([prompt], greedy(12, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert stop not in out.text
    assert full.text.startswith(out.text)


def test_logprobs_match_the_models_distribution(llm: LLM, default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = "The sky is"
    [out] = llm.generate([prompt], greedy(1, logprobs=3), use_tqdm=False)
    [step] = out.outputs[0].logprobs or []
    ids = torch.tensor([out.prompt_token_ids])
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(ids).logits[0, -1], -1)
    top = torch.topk(ref, 3)
    sampled = out.outputs[0].token_ids[0]
    assert sampled == int(top.indices[0])
    assert set(step) == {int(i) for i in top.indices}
    for token, logprob in step.items():
        assert logprob == pytest.approx(float(ref[token]), abs=1e-3)


def test_n_samples_with_seed_are_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=7, max_tokens=12)
    first = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    again = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_bad_inputs_raise_clear_errors_and_leave_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [1] * 9000}], use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [greedy(1), greedy(1)], use_tqdm=False)
    # A bad prompt after good ones: the good ones are withdrawn too.
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", "also fine", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.pool.is_whole()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_unknown_model_and_architecture_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(str(tmp_path), blok_size=16)
