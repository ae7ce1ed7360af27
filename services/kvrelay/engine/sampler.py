"""Sampler: one step's logits [S, V] plus each row's SamplingParams -> next token per row.

Batched over rows; per-request seeded generators make a row's tokens independent of its batch.
Pure library: no I/O, never modifies the logits it is given.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, overload

import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.grammar_mask import masked_logits
from kvrelay.engine.penalties import (
    apply_logit_bias,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    flatten_token_ids,
    mask_tokens,
)
from kvrelay.engine.sampling_ops import argmax, sample_inverse_cdf, truncation_threshold

# The clamps live here, not in SamplingParams: they are limits of this fp32 arithmetic, and the
# params keep what the client asked for (vLLM accepts any penalty > 0 and temperature >= 0).
# A seen logit of magnitude L becomes at most L / MIN_REPETITION_PENALTY / GREEDY_EPS ~ 1e11 L
# after the penalty and the temperature: finite in fp32 for any L below ~1e27, where 1e-40
# would round to 0 (logit / 0 = inf -> NaN probabilities -> an out-of-vocabulary token).
MIN_REPETITION_PENALTY = 2.0**-20
MAX_REPETITION_PENALTY = 2.0**20
# Above this every realistic logit spread (< 1e3) is flattened to within 0.1% of uniform, so
# the clamp changes nothing measurable; 1e300 would round to inf in fp32 and -inf / inf = NaN.
MAX_TEMPERATURE = 2.0**20

# The Triton sampler (kvrelay_kernels/triton_sampling.py) under "sample_rows", imported on the
# first CUDA batch only (a CPU process never imports Triton from here); None without Triton.
# Tests put stand-ins here (tests/fake_cuda/kernels.py).
DeviceSampler = Callable[..., torch.Tensor]
_device_state: dict[str, DeviceSampler | None] = {}
_device_lock = threading.Lock()


class SamplingRow(NamedTuple):
    """One sequence being sampled this step. (A NamedTuple: the runner builds one per running
    request per step, and a frozen dataclass costs twice as much to build.)"""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far by this sequence
    generator: torch.Generator | None  # per-request seeded CPU RNG (None: the batch RNG)
    eos_token_ids: tuple[int, ...]  # the model's EOS ids (min_tokens masks them)
    # Structured outputs: the sample's llguidance matcher (read here, advanced by the engine)
    matcher: Any = None


class GreedyRows(Sequence[SamplingRow]):
    """Rows that are all greedy with nothing to apply before the argmax: no grammar, penalty,
    logit bias, logprobs nor min_tokens (`Request.plain_greedy`). The sampler takes their
    argmax without reading a row, so a served batch of such requests builds no row per step;
    a row is made only when one is read (a failed step's row-by-row retry, isolation.py)."""

    def __init__(self, count: int, row: Callable[[int], SamplingRow]) -> None:
        self._count = count
        self._row = row

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> SamplingRow: ...

    @overload
    def __getitem__(self, index: slice) -> list[SamplingRow]: ...

    def __getitem__(self, index: int | slice) -> SamplingRow | list[SamplingRow]:
        if isinstance(index, slice):
            return [self._row(i) for i in range(*index.indices(self._count))]
        if not -self._count <= index < self._count:
            raise IndexError(f"row {index} of {self._count}")
        return self._row(index % self._count)


@dataclass(frozen=True)
class SampleLogprobs:
    token_logprob: float  # logprob of the sampled token
    top: list[tuple[int, float]]  # top-k (token id, logprob), best first; k = params.logprobs


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[SampleLogprobs | None]  # None where params.logprobs is None


class Sampler:
    """Chooses the next token of every row, in this order (vLLM V1's):

    0. rows with a grammar (structured outputs): every token it refuses -> -inf, first, so
       that everything below, logprobs included, sees only what the grammar allows;
    1. logprobs come from the raw logits (log_softmax before any penalty or temperature);
    2. min_tokens: while fewer than min_tokens were generated, EOS and stop_token_ids -> -inf
       (EOS even with ignore_eos, as vLLM does; under a grammar, not where they are all it
       allows: its end wins, grammar_mask.py);
    3. repetition penalty over prompt and output tokens;
    4. presence and frequency penalties over output tokens;
    5. greedy rows: argmax (lowest index on ties);
    6. the others: temperature -> top-k -> top-p -> min-p -> one draw.

    A row with a generator draws only from it (one uniform per step), so the same seed gives
    the same tokens whatever else is in the batch; the other rows share the Sampler's RNG.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self._generator = generator if generator is not None else torch.Generator()
        if generator is None:
            self._generator.seed()  # nondeterministic, like torch's default RNG

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, rows, self.draw_uniforms(rows))

    def draw_uniforms(self, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The uniform in [0, 1) each non-greedy row draws this step ([S]; 0 for greedy rows):
        seeded rows from their own generator (one draw each), the others from the Sampler's,
        which advances by the number of non-greedy rows. Drawn before any row's arithmetic
        runs, so a caller can re-run `sample` on some rows after a failure without drawing
        again."""
        if isinstance(rows, GreedyRows):
            return torch.zeros(len(rows))  # [S]: no row draws
        u = torch.zeros(len(rows))  # [S]
        rand_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if rand_rows:
            u[rand_rows] = self._uniforms([rows[i] for i in rand_rows])
        return u

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], uniforms: torch.Tensor
    ) -> SamplerOutput:
        """Tokens of `rows` from their logits [S, V] and `draw_uniforms(rows)` [S]; draws
        nothing. A row's result depends only on its own logits, params, history and uniform.

        Raises:
            ValueError: bad shapes, or a row whose arithmetic gave no valid token id.
        """
        # logits: [S, V], fp32 (other float types are upcast)
        if logits.dim() != 2 or logits.shape[0] != len(rows) or uniforms.shape != (len(rows),):
            raise ValueError(
                f"logits must be [len(rows)={len(rows)}, V] and uniforms [{len(rows)}], got "
                f"{tuple(logits.shape)} and {tuple(uniforms.shape)}"
            )
        tokens, raw_logprobs = self.sample_on_device(logits, rows, uniforms)
        # The step's one host sync: the sampled ids come back (the logprobs, when asked for,
        # follow in a fixed number of copies, never one per row).
        token_ids: list[int] = tokens.tolist()
        _check_token_ids(token_ids, logits.shape[1])
        if isinstance(rows, GreedyRows):
            return SamplerOutput(token_ids, [None] * len(rows))
        params = [r.params for r in rows]
        return SamplerOutput(token_ids, _gather_logprobs(raw_logprobs, params, tokens))

    def read_tokens(self, tokens: torch.Tensor) -> list[int]:
        """A step's sampled ids from their host copy, once its copy is done (async
        scheduling's one read per step: engine/async_step.py). The fake-CUDA rig replaces
        it: fake tensors have no values."""
        return tokens.tolist()

    def sample_on_device(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[list[int], torch.Tensor | None]]:
        """`sample` up to its sync: the [S] int64 token ids and the raw logprobs of the rows
        that asked for them, all on the logits' device (nothing read back to the host)."""
        if isinstance(rows, GreedyRows):
            return argmax(_fp32(logits)), ([], None)
        params = [r.params for r in rows]
        grammar_rows = [i for i, r in enumerate(rows) if r.matcher is not None]
        if grammar_rows:  # a masked copy; min_tokens is applied there for these rows
            logits = masked_logits(logits, rows, grammar_rows)
        raw_logprobs = self._raw_logprobs(logits, params)
        min_rows = [
            i
            for i, r in enumerate(rows)
            if len(r.output_token_ids) < r.params.min_tokens and r.matcher is None
        ]
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        rand_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        if not (min_rows or pen_rows or rand_rows or bias_rows):
            # The hot path: greedy, no penalty: nothing to copy or modify.
            tokens = argmax(_fp32(logits))
        else:
            x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            # vLLM's order: the bias first, then the min_tokens mask and the penalties.
            apply_logit_bias(x, [params[i].logit_bias for i in bias_rows], bias_rows)
            self._mask_min_tokens(x, rows, min_rows)
            self._penalise(x, rows, pen_rows)
            tokens = self._choose(x, rows, rand_rows, uniforms)
        return tokens, raw_logprobs

    # --- steps -------------------------------------------------------------------------------

    @staticmethod
    def _raw_logprobs(
        logits: torch.Tensor, params: Sequence[SamplingParams]
    ) -> tuple[list[int], torch.Tensor | None]:
        idx = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not idx:
            return idx, None
        return idx, logits[device_index(idx, logits.device)].float().log_softmax(dim=-1)  # [L, V]

    @staticmethod
    def _mask_min_tokens(x: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
        if not idx:
            return
        banned = [(*rows[i].params.stop_token_ids, *rows[i].eos_token_ids) for i in idx]
        r, t = flatten_token_ids(banned, idx, x.shape[1], x.device)
        mask_tokens(x, r, t)

    @staticmethod
    def _penalise(x: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
        if not idx:
            return
        vocab, dev = x.shape[1], x.device
        rep = [i for i in idx if rows[i].params.repetition_penalty != 1.0]
        if rep:
            penalty = torch.ones(x.shape[0], dtype=x.dtype)  # [S], built on the host
            penalty[rep] = torch.tensor(
                [_clamp_repetition_penalty(rows[i].params.repetition_penalty) for i in rep],
                dtype=x.dtype,
            )
            seqs = [rows[i].prompt_token_ids for i in rep] + [rows[i].output_token_ids for i in rep]
            r, t = flatten_token_ids(seqs, rep + rep, vocab, dev)
            apply_repetition_penalty(x, r, t, penalty.to(dev, non_blocking=True))
        add = [
            i
            for i in idx
            if rows[i].params.presence_penalty != 0.0 or rows[i].params.frequency_penalty != 0.0
        ]
        if add:
            presence = torch.zeros(x.shape[0], dtype=x.dtype)  # [S], built on the host
            frequency = torch.zeros_like(presence)  # [S]
            presence[add] = torch.tensor(
                [rows[i].params.presence_penalty for i in add], dtype=x.dtype
            )
            frequency[add] = torch.tensor(
                [rows[i].params.frequency_penalty for i in add], dtype=x.dtype
            )
            r, t = flatten_token_ids([rows[i].output_token_ids for i in add], add, vocab, dev)
            apply_presence_frequency_penalties(
                x,
                r,
                t,
                presence.to(dev, non_blocking=True),
                frequency.to(dev, non_blocking=True),
            )

    @staticmethod
    def _choose(
        x: torch.Tensor, rows: Sequence[SamplingRow], rand_rows: list[int], u: torch.Tensor
    ) -> torch.Tensor:
        # x: [S, V] penalised logits, u: [S] uniforms -> [S] int64 token ids
        if not rand_rows:
            return argmax(x)
        tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)  # [S]
        rand_set = set(rand_rows)
        greedy_rows = [i for i in range(x.shape[0]) if i not in rand_set]
        if greedy_rows:
            greedy = device_index(greedy_rows, x.device)
            tokens[greedy] = argmax(x[greedy]).to(x.device)  # numpy's is on the CPU
        rand = [rows[i] for i in rand_rows]
        on_device = device_index(rand_rows, x.device)
        tokens[on_device] = Sampler._sample(x[on_device], rand, u[rand_rows])  # u: on the host
        return tokens

    @staticmethod
    def _sample(x: torch.Tensor, rows: Sequence[SamplingRow], u: torch.Tensor) -> torch.Tensor:
        # x: [R, V] penalised logits of the non-greedy rows (a copy: edited in place); u: [R]
        vocab, dev = x.shape[1], x.device
        ps = [r.params for r in rows]
        fused = device_sampler(x)
        if fused is not None:
            return _sample_fused(fused, x, ps, u)
        temps = [min(p.temperature, MAX_TEMPERATURE) for p in ps]
        temp = torch.tensor(temps, dtype=x.dtype).to(dev, non_blocking=True)  # [R]
        x.div_(temp[:, None])
        thresh = None
        if any(p.uses_top_k or p.uses_top_p or p.uses_min_p for p in ps):
            # On the host: truncation_threshold reads them to pick its branches (no sync).
            top_k = torch.tensor([min(p.top_k, vocab) if p.uses_top_k else vocab for p in ps])
            top_p = torch.tensor([p.top_p for p in ps], dtype=x.dtype)  # [R]
            min_p = torch.tensor([p.min_p for p in ps], dtype=x.dtype)  # [R]
            thresh = truncation_threshold(x, top_k, top_p, min_p)  # [R]
        probs = x.softmax(dim=-1)  # [R, V]
        if thresh is not None:
            probs.mul_(x >= thresh[:, None])
        return sample_inverse_cdf(probs, u.to(dev, non_blocking=True))

    def _uniforms(self, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One uniform in [0, 1) per row: seeded rows from their own generator, others shared."""
        u = torch.rand(len(rows), generator=self._generator)  # [R]
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = _seeded_uniform(r.generator)
        return u


def _fp32(logits: torch.Tensor) -> torch.Tensor:
    """`logits` as fp32: themselves when they are (`float()` would still be a device op)."""
    return logits if logits.dtype == torch.float32 else logits.float()


def device_sampler(x: torch.Tensor) -> DeviceSampler | None:
    """The one-launch Triton sampler when `x` is on a CUDA device and Triton is installed;
    None elsewhere (the torch ops serve: always on the CPU)."""
    if not x.is_cuda:
        return None
    with _device_lock:
        if "sample_rows" not in _device_state:
            fn: DeviceSampler | None = None
            if importlib.util.find_spec("triton") is not None:
                from kvrelay_kernels.triton_sampling import sample_rows

                fn = sample_rows
            _device_state["sample_rows"] = fn
        return _device_state["sample_rows"]


def _sample_fused(
    fused: DeviceSampler, x: torch.Tensor, ps: Sequence[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """`Sampler._sample` as one kernel: the rows' parameters are built in one host tensor and
    uploaded in ONE non-blocking copy (five would be five copies), then split on the device.
    x: [R, V] penalised logits (not modified); u: [R] uniforms on the host -> [R] int64."""
    rows, vocab = x.shape
    host = torch.empty(5, rows, dtype=torch.float32)  # [5, R]
    host[0] = torch.tensor([min(p.temperature, MAX_TEMPERATURE) for p in ps])
    top_k = [min(p.top_k, vocab) if p.uses_top_k else vocab for p in ps]
    host[1].view(torch.int32)[:] = torch.tensor(top_k, dtype=torch.int32)  # bits, not values
    host[2] = torch.tensor([p.top_p for p in ps])
    host[3] = torch.tensor([p.min_p for p in ps])
    host[4] = u
    dev = host.to(x.device, non_blocking=True)
    return fused(x, dev[0], dev[1].view(torch.int32), dev[2], dev[3], dev[4])


def device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """`rows` as an int64 index tensor on `device`. Indexing a device tensor with a Python list
    makes torch build the index on the host and copy it up blocking (a stream sync on CUDA);
    this one is uploaded without waiting."""
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


def _seeded_uniform(generator: torch.Generator) -> torch.Tensor:
    """The one draw a seeded sample makes per token."""
    return torch.rand(1, generator=generator)[0]


def skip_seeded_draws(generator: torch.Generator, count: int) -> None:
    """Advance a sample's own generator past `count` tokens sampled by another engine (the
    prefill worker's first token, or a worker that died mid-stream), so that this engine goes
    on with the seeded stream exactly where the other left it."""
    for _ in range(count):
        _seeded_uniform(generator)


def _clamp_repetition_penalty(penalty: float) -> float:
    return min(max(penalty, MIN_REPETITION_PENALTY), MAX_REPETITION_PENALTY)


def _check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    # NaN probabilities (non-finite logits) make the inverse-CDF draw return vocab_size: an id
    # that would break the next forward pass of every request in the batch, so refuse it here.
    # Checked on the host list, after the step's one sync, so it adds none.
    if token_ids and min(token_ids) >= 0 and max(token_ids) < vocab_size:
        return  # in C: a step of 256 rows makes no Python comparison per row
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"sampled token ids {bad} outside the vocabulary [0, {vocab_size})")


def _gather_logprobs(
    raw: tuple[list[int], torch.Tensor | None],
    params: Sequence[SamplingParams],
    tokens: torch.Tensor,
) -> list[SampleLogprobs | None]:
    # tokens: [S] int64 sampled ids, on lp's device
    out: list[SampleLogprobs | None] = [None] * len(params)
    idx, lp = raw  # lp: [L, V] raw logprobs of rows idx
    if lp is None:
        return out
    k_max = max(params[i].logprobs or 0 for i in idx)
    chosen = lp.gather(1, tokens[device_index(idx, lp.device)][:, None]).squeeze(1).tolist()
    top_v, top_i = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())  # [L, k]
    # Whole tensors come back at once: one copy each, not two per row.
    values, ids = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(idx):
        k = params[i].logprobs or 0
        out[i] = SampleLogprobs(chosen[j], list(zip(ids[j][:k], values[j][:k], strict=True)))
    return out
