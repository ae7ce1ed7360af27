"""The offline API in vLLM's convention: `LLM(model).generate(prompts, params)` and `.chat()`.

It runs one engine in this process and drives its steps until the given requests finish.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeAlias

from tqdm import tqdm

from kvrelay.common.messages import RequestFailedError
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.args import EngineArgs
from kvrelay.engine.outputs import RequestOutput

# A prompt is text, or {"prompt_token_ids": [...]} (optionally with "prompt": text).
Prompt: TypeAlias = str | Mapping[str, Any]
Message: TypeAlias = Mapping[str, str]


class LLM:
    """A model served in-process.

    Args:
        model: a Hugging Face model folder, or a Hugging Face id ORG/NAME[@REVISION] (from
            the Hugging Face cache, else downloaded; HF_HUB_OFFLINE=1: the cache only); None
            for the embedded default model.
        **engine_args: any `EngineArgs` field (block_size, num_blocks, kv_cache_memory,
            max_num_batched_tokens, max_num_seqs, max_model_len, dtype, seed, ...).

    Raises:
        ValueError: an engine argument out of its range, naming it (before anything loads).
        FileNotFoundError: a model that is neither a folder nor an id that can be had.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = EngineArgs.from_kwargs(model, engine_args).create_engine()
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("the model folder has no tokenizer files")
        self.tokenizer: Any = tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt as one continuous batch; outputs in the prompts' order.

        A request the engine had to fail alone (e.g. sampling parameters its arithmetic could
        not apply) does not fail the others: its output is finished with `error` set (a
        message) and its samples' finish_reason "abort"; check `output.error`.

        Raises:
            ValueError: a bad prompt (empty, too long) or a params list of the wrong length;
                no request is left running.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        params = _per_prompt(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(
                f"priority has {len(priorities)} entries for {len(prompt_list)} prompts"
            )
        ids: list[str] = []
        try:
            for prompt, sp, prio in zip(prompt_list, params, priorities, strict=True):
                ids.append(self._add(prompt, sp, prio))
        except BaseException:
            for request_id in ids:  # a bad prompt leaves nothing queued behind it
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations: list[Sequence[Message]]
        if messages and isinstance(messages[0], Mapping):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        prompts = [self.chat_prompt(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(
        self, conversation: Sequence[Message], add_generation_prompt: bool = True
    ) -> dict[str, Any]:
        """The templated prompt of a conversation, as text and token ids."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: use generate() with plain text")
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in conversation],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        # The template already holds every special token it wants.
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"prompt": text, "prompt_token_ids": ids}

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Generate for one prompt, yielding new text as soon as it is stable.

        Closing the iterator early aborts the request.

        Raises:
            RequestFailedError: the engine failed the request (`RequestOutput.error`).
        """
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream() yields one sample: use n=1")
        request_id = self._add(prompt, params, 0)
        sent = 0
        try:
            while self.engine.has_unfinished_requests():
                # A running plain request's tokens come as rows (StepDelta): this request,
                # with text, never does; its outputs are the cumulative ones.
                for output in self.engine.step_delta().outputs:
                    if output.request_id != request_id:
                        continue
                    if output.error is not None:
                        raise RequestFailedError(output.error)
                    text = output.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if output.finished:
                        return
        finally:
            self.engine.abort(request_id)

    def _add(self, prompt: Prompt, params: SamplingParams, priority: int) -> str:
        text, ids = self._tokenize(prompt)
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, ids, params, prompt=text, priority=priority)
        return request_id

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text or prompt_token_ids")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if "prompt_token_ids" not in prompt:
            raise ValueError("a prompt dict needs 'prompt_token_ids' (a list of token ids)")
        return prompt.get("prompt"), list(prompt["prompt_token_ids"])

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(
            total=len(request_ids), desc="generating", unit="req", disable=not use_tqdm
        ) as bar:
            try:
                while len(finished) < len(request_ids):
                    # Only final outputs are kept: a step's rows (one token of a running
                    # request) need no cumulative output built (Engine.step_delta).
                    for output in self.engine.step_delta().outputs:
                        if output.finished and output.request_id in wanted:
                            finished[output.request_id] = output
                            bar.update(1)
            finally:
                for request_id in wanted - finished.keys():
                    self.engine.abort(request_id)
        return [finished[i] for i in request_ids]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(
            f"got {len(params)} SamplingParams for {count} prompts: give one or one each"
        )
    return list(params)
