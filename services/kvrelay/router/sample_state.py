"""One sample's output as the router assembles it from worker deltas.

Detokenization and stop strings live here, in the router (as vLLM's front end does them): the
worker only generates tokens, and is aborted when a stop string matches. Deltas are lined up by
token position, so a stream that repeats tokens (a recompute after a failed relay) adds only
the new ones.
"""

from __future__ import annotations

from kvrelay.common.detokenizer import IncrementalDetokenizer, Tokenizer
from kvrelay.common.messages import SampleDelta
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.router.types import ChoiceDelta, TokenLogprob


def to_token_logprob(token_id: int, entry: dict[int, float]) -> TokenLogprob:
    top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
    return TokenLogprob(token_id, entry.get(token_id, float("-inf")), top)


class SampleState:
    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer | None,
        params: SamplingParams,
        prompt_token_ids: list[int],
        include_stop_str: bool = False,
    ) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._min_tokens = params.min_tokens
        self._include_stop = include_stop_str
        self._holdback = max((len(stop) for stop in params.stop), default=1) - 1
        self._sent = 0  # characters of the text already sent
        # No tokenizer (a model served on token ids alone): token ids only, no text.
        self._detok = (
            IncrementalDetokenizer(
                tokenizer, params.skip_special_tokens, params.stop, prompt_token_ids
            )
            if tokenizer is not None
            else None
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._detok.text if self._detok is not None else ""

    def feed(self, delta: SampleDelta) -> ChoiceDelta | None:
        """Take a worker delta; the news for the client (None when there is none)."""
        if self.finished:
            return None
        skip = len(self.token_ids) - delta.start  # tokens of this delta already taken
        if skip < 0:
            raise ValueError(f"a gap in sample {self.index}'s tokens at {len(self.token_ids)}")
        new_ids = delta.token_ids[skip:]
        logprobs = delta.logprobs[skip:] if delta.logprobs is not None else None
        out = ChoiceDelta(self.index, logprobs=[] if logprobs is not None else None)
        for offset, token_id in enumerate(new_ids):
            self.token_ids.append(token_id)
            out.token_ids.append(token_id)
            if out.logprobs is not None and logprobs is not None:
                out.logprobs.append(to_token_logprob(token_id, logprobs[offset]))
            stop = self._detok.add(token_id)[1] if self._detok is not None else None
            if stop is not None and len(self.token_ids) >= self._min_tokens:
                self.finish_reason, self.stop_reason = "stop", stop
                break
        if not self.finished and delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        out.text = self._new_text()
        out.finish_reason, out.stop_reason = self.finish_reason, self.stop_reason
        if not out.token_ids and not out.text and out.finish_reason is None:
            return None
        return out

    def _new_text(self) -> str:
        """Text not sent yet. While running, the last `holdback` characters wait: they may be
        the start of a stop string, which the client must never see (vLLM does the same)."""
        text = self.text
        if (
            self.finish_reason == "stop"
            and self._include_stop
            and isinstance(self.stop_reason, str)
        ):
            text += self.stop_reason
        end = len(text) if self.finished else max(self._sent, len(text) - self._holdback)
        new = text[self._sent : end]
        self._sent = end
        return new

    def abort(self) -> ChoiceDelta:
        self.finish_reason = "abort"
        return ChoiceDelta(self.index, finish_reason="abort")
