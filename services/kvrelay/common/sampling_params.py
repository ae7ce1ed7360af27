"""SamplingParams: how one request's tokens are chosen, in vLLM's conventions.

Validated on construction (ValueError naming the field); holds no tensors and applies nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.common.structured_outputs import StructuredOutputs

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# logit_bias: OpenAI's range per token, and a bound on the entries one request may send (each
# costs a scatter into its row of every step's logits).
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts up to a uint64
# Every other int field must fit an int64: the sampler builds int64 tensors (numpy arrays) of
# them, and a larger one would raise OverflowError inside an engine step, failing its batch.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; `n=True` is a caller's mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def _check_int64(name: str, value: object) -> int:
    i = _check_int(name, value)
    if not _INT64_MIN <= i <= _INT64_MAX:
        raise ValueError(f"{name} must fit in a signed 64-bit int (below 2**63), got {i}")
    return i


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    f = float(value)
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {f}")
    return f


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; defaults are vLLM's.

    temperature 0 is greedy; top_k 0 or -1, top_p 1 and min_p 0 disable those filters.
    max_tokens None means "up to the context length". logprobs k returns the sampled token's
    logprob plus the top k. stop strings are stored here and matched by the router.
    Sequences given as lists are stored as tuples so that an instance is immutable and hashable.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = field(default=())
    stop: Sequence[str] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # (token id, bias) pairs; a {token id: bias} mapping is accepted too.
    logit_bias: Sequence[tuple[int, float]] = field(default=())
    # What the output must match (JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputs | None = None
    # vLLM's prompt_logprobs: each prompt token's logprob (and rank) plus the top k at its
    # position (None: not computed; a request that asks skips the prefix cache).
    prompt_logprobs: int | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled (None: any). Stored sorted,
    # each once.
    allowed_token_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        # Floats are normalised (an int 0 becomes 0.0) so equality and hashing behave.
        set_ = object.__setattr__
        set_(self, "n", self._n())
        set_(self, "temperature", self._temperature())
        set_(self, "top_p", self._top_p())
        set_(self, "top_k", self._top_k())
        set_(self, "min_p", self._min_p())
        set_(self, "repetition_penalty", self._repetition_penalty())
        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, self._additive_penalty(name))
        set_(self, "seed", self._seed())
        set_(self, "max_tokens", self._max_tokens())
        set_(self, "min_tokens", self._min_tokens())
        set_(self, "stop_token_ids", self._stop_token_ids())
        set_(self, "stop", self._stop())
        set_(self, "ignore_eos", _check_bool("ignore_eos", self.ignore_eos))
        set_(self, "logprobs", self._logprobs())
        set_(
            self,
            "skip_special_tokens",
            _check_bool("skip_special_tokens", self.skip_special_tokens),
        )
        set_(self, "logit_bias", self._logit_bias())
        set_(self, "prompt_logprobs", self._prompt_logprobs())
        set_(self, "allowed_token_ids", self._allowed_token_ids())
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            raise ValueError("structured_outputs must be a StructuredOutputs or None")

    # --- validators: each returns the normalised value or raises ValueError --------------------

    def _n(self) -> int:
        n = _check_int64("n", self.n)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return n

    def _temperature(self) -> float:
        t = _check_float("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {t}")
        return t

    def _top_p(self) -> float:
        p = _check_float("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        return p

    def _top_k(self) -> int:
        k = _check_int64("top_k", self.top_k)
        if k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {k}")
        return k

    def _min_p(self) -> float:
        p = _check_float("min_p", self.min_p)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p}")
        return p

    def _repetition_penalty(self) -> float:
        r = _check_float("repetition_penalty", self.repetition_penalty)
        if r <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {r}")
        return r

    def _additive_penalty(self, name: str) -> float:
        v = _check_float(name, getattr(self, name))
        if not -2.0 <= v <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {v}")
        return v

    def _seed(self) -> int | None:
        if self.seed is None:
            return None
        s = _check_int("seed", self.seed)
        if not 0 <= s <= _MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {s}")
        return s

    def _max_tokens(self) -> int | None:
        if self.max_tokens is None:
            return None
        m = _check_int64("max_tokens", self.max_tokens)
        if m < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {m}")
        return m

    def _min_tokens(self) -> int:
        m = _check_int64("min_tokens", self.min_tokens)
        if m < 0:
            raise ValueError(f"min_tokens must be >= 0, got {m}")
        if self.max_tokens is not None and m > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {m}")
        return m

    def _stop_token_ids(self) -> tuple[int, ...]:
        ids = _as_tuple("stop_token_ids", self.stop_token_ids)
        for i in ids:
            if _check_int64("stop_token_ids", i) < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {i}")
        return ids

    def _stop(self) -> tuple[str, ...]:
        # OpenAI accepts one string or a list; a bare str would otherwise split into characters.
        stops = (self.stop,) if isinstance(self.stop, str) else _as_tuple("stop", self.stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        return stops

    def _logprobs(self) -> int | None:
        if self.logprobs is None:
            return None
        k = _check_int64("logprobs", self.logprobs)
        if not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {k}")
        return k

    def _prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is None:
            return None
        k = _check_int64("prompt_logprobs", self.prompt_logprobs)
        if not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {k}")
        return k

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        raw: object = self.logit_bias
        pairs = list(raw.items()) if isinstance(raw, Mapping) else _as_tuple("logit_bias", raw)
        if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(
                f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(pairs)}"
            )
        biases: dict[int, float] = {}
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"logit_bias must map token ids to numbers, got {pair!r}")
            token = _check_int64("logit_bias", pair[0])
            bias = _check_float("logit_bias", pair[1])
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias} for token {token}"
                )
            if token in biases:
                raise ValueError(f"logit_bias names token {token} twice")
            biases[token] = bias
        return tuple(sorted(biases.items()))

    def _allowed_token_ids(self) -> tuple[int, ...] | None:
        if self.allowed_token_ids is None:
            return None
        ids = _as_tuple("allowed_token_ids", self.allowed_token_ids)
        if not ids:
            raise ValueError("allowed_token_ids must name at least one token (None allows all)")
        for i in ids:
            if _check_int64("allowed_token_ids", i) < 0:
                raise ValueError(f"allowed_token_ids must be non-negative ints, got {i}")
        return tuple(sorted(set(ids)))

    # --- derived -----------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` (of `n`) run as a request of its own: n = 1, and a
        seeded request's sample draws from seed + index (mod 2**64), so each sample is what a
        separate request with that seed gives. The one n > 1 fan-out rule (engine and router)."""
        seed = None if self.seed is None else (self.seed + index) % (_MAX_SEED + 1)
        return dataclasses.replace(self, n=1, seed=seed)

    @classmethod
    def greedy(cls, **kwargs: Any) -> SamplingParams:
        """Greedy decoding (temperature 0); other fields as given."""
        return cls(temperature=0.0, **kwargs)


def check_vocab(field: str, token_ids: Iterable[int], vocab_size: int) -> None:
    """The one vocabulary rule, for the router (its tokenizer's size) and the engine (its
    model's): every token id given in `field` lies in [0, vocab_size).

    Raises:
        ValueError: naming `field` and its first id outside the vocabulary.
    """
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"{field}: token id {bad} is outside the vocabulary; token ids must be in "
            f"[0, {vocab_size})"
        )


def _as_tuple(name: str, value: object) -> tuple[Any, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise ValueError(f"{name} must be a list or tuple, got {type(value).__name__} {value!r}")
