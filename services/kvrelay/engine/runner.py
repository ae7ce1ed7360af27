"""Turns a scheduled batch into model inputs, runs the forward pass and samples next tokens.

It owns the model, the KV tensor and the sampler; it never decides what to run (the scheduler
does) nor what a token means for the request (the engine does).
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvrelay.engine.cuda_graphs import DecodeGraphs
from kvrelay.engine.isolation import sample_isolating
from kvrelay.engine.prompt_logprobs import PromptScores, score_prompts, scored_rows
from kvrelay.engine.request import Request
from kvrelay.engine.sampler import GreedyRows, SampleLogprobs, Sampler, SamplingRow
from kvrelay.engine.scheduled import ScheduledChunk
from kvrelay.engine.step_upload import StepUploader
from kvrelay.models.inputs import AttentionInputs
from kvrelay_kernels import AttentionBackend
from kvrelay_kernels.counters import COUNTERS

logger = logging.getLogger(__name__)

# Async scheduling: writes the decode rows' input ids (a [T] device tensor) from the tokens
# the previous step sampled, still on the device (engine/async_step.py).
Feed = Callable[[torch.Tensor], None]


class FeedEveryRow:
    """A `Feed` that writes every row (a steady decode batch: the previous step sampled the
    same requests in the same order): the rows' last tokens on the host are not read."""

    __slots__ = ("source",)

    def __init__(self, source: torch.Tensor) -> None:
        self.source = source  # [T] int64, on the device

    def __call__(self, input_ids: torch.Tensor) -> None:
        input_ids.copy_(self.source)


# ScheduledChunk's fields by position (a NamedTuple), and a request's id.
_REQUEST, _START = operator.itemgetter(0), operator.itemgetter(1)
_REQUEST_ID = operator.attrgetter("request_id")
_PLAIN_GREEDY = operator.attrgetter("plain_greedy")
_MATCHER = operator.attrgetter("matcher")


class CausalLMModel(Protocol):
    """What the runner needs of a model (kvrelay.models)."""

    backend: AttentionBackend  # the kernel ops; the runner uses its copy_blocks

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionInputs,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class StepResult(NamedTuple):
    """What one step sampled, in chunk order (forks after their leader): each sampled
    request with its token and logprobs, as parallel lists (a step of 256 decodes makes no
    object per row), and the requests whose sampling failed alone (their traceback logged;
    the others unaffected; their entries in the lists are placeholders)."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]
    failed: list[Request]
    # Prompt tokens scored this step, for requests with prompt_logprobs (prompt_logprobs.py).
    prompt_scores: Sequence[PromptScores] = ()
    # Async scheduling (`defer_read`): the [len(requests)] int64 tokens on the device, not
    # read yet (token_ids and logprobs then empty); None: read (token_ids holds them).
    device_tokens: torch.Tensor | None = None

    @classmethod
    def empty(cls, prompt_scores: Sequence[PromptScores] = ()) -> StepResult:
        return cls([], [], [], [], prompt_scores)


@dataclass(frozen=True)
class BatchInputs:
    """Flattened model inputs of one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionInputs
    logits_indices: torch.Tensor  # [num_sampled] int64 row of each sampled chunk's last token

    def to(self, device: torch.device) -> BatchInputs:
        """The step's inputs on `device`: built on the host, uploaded once per step without
        waiting (`non_blocking`); `self` on the CPU, so the CPU path pays nothing. The
        engine's runner uploads through `StepUploader` instead (one pinned copy, block tables
        kept on the device); this is for callers holding a plain batch.
        """
        if self.input_ids.device == device:
            return self
        return BatchInputs(
            self.input_ids.to(device, non_blocking=True),
            self.positions.to(device, non_blocking=True),
            self.attn.to(device, non_blocking=True),
            self.logits_indices.to(device, non_blocking=True),
        )


def build_batch_inputs(
    chunks: Sequence[ScheduledChunk],
    block_tables: Sequence[list[int]],
    block_size: int,
    num_blocks: int | None = None,
) -> BatchInputs:
    """Flatten the chunks into token, position, slot and block-table tensors, on the host (the
    plan reads their values: on a device that would be a sync); `BatchInputs.to` uploads.

    Vectorized over the batch (numpy): at 256 running requests a per-token Python loop cost
    ~4 ms a step, more than an H200 takes to run the step (benchmarks/host_overhead.py)."""
    n = len(chunks)
    token_ids, q_list, start_list = _chunk_columns(chunks)
    q_lens = np.array(q_list, np.int64)
    starts = np.array(start_list, np.int64)
    query_start_loc = np.zeros(n + 1, np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    seq_of_token = np.repeat(np.arange(n), q_lens)  # [T] the chunk each token belongs to
    positions = np.arange(len(token_ids)) - query_start_loc[seq_of_token] + starts[seq_of_token]
    table = padded_block_table(block_tables)
    slots = table[seq_of_token, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    samples = np.fromiter((c.samples for c in chunks), np.bool_, n)
    attn = AttentionInputs.build(
        slot_mapping=torch.from_numpy(slots),
        block_tables=torch.from_numpy(table),
        seq_lens=torch.from_numpy((starts + q_lens).astype(np.int32)),
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
        block_size=block_size,
        num_blocks=num_blocks,
    )
    return BatchInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=torch.from_numpy(positions),
        attn=attn,
        logits_indices=torch.from_numpy(query_start_loc[1:][samples] - 1),
    )


def _chunk_columns(chunks: Sequence[ScheduledChunk]) -> tuple[list[int], list[int], list[int]]:
    """The chunks' token ids (flattened), lengths and starts, in one pass over the batch. A
    decode's one token is its last output token, read directly (every running request, every
    step)."""
    token_ids: list[int] = []
    q_lens: list[int] = []
    starts: list[int] = []
    for chunk in chunks:
        request, start, size = chunk.request, chunk.start, chunk.num_tokens
        q_lens.append(size)
        starts.append(start)
        outputs = request.output_token_ids
        known = len(request.prompt_token_ids) + len(outputs)
        if size == 1 and start == known - 1 and outputs:
            token_ids.append(outputs[-1])
        elif start == known:  # async scheduling: its token is on the device (Feed fills it)
            token_ids.append(0)
        else:
            token_ids.extend(request.token_ids(start, start + size))
    return token_ids, q_lens, starts


def padded_block_table(block_tables: Sequence[list[int]]) -> npt.NDArray[np.int32]:
    """`[len(block_tables), longest]` int32, each table's block ids then zeros."""
    lens = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
    table = np.zeros((len(block_tables), int(lens.max())), np.int32)
    # Row-major order of the mask is the tables' order, one after the other.
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), np.int32, int(lens.sum()))
    table[np.arange(table.shape[1]) < lens[:, None]] = flat
    return table


class StepTensors(NamedTuple):
    """A step's inputs where the model runs: the batch, the copy-on-write block pairs (None
    when there are none) and the logits row of each sampled request (None: one per chunk)."""

    inputs: BatchInputs
    copy_src: torch.Tensor | None
    copy_dst: torch.Tensor | None
    logits_rows: torch.Tensor | None


class ModelRunner:
    """Runs one step of the model on the worker's KV tensor."""

    def __init__(
        self,
        model: CausalLMModel,
        kv_cache: torch.Tensor,
        block_size: int,
        sampler: Sampler,
        *,
        max_blocks_per_seq: int | None = None,
        max_num_seqs: int = 128,
    ) -> None:
        """`max_blocks_per_seq` (default: every block of the cache) sizes the device block
        table's rows, `max_num_seqs` its initial row count (it grows when needed)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device  # every step tensor is moved here, once per step
        self.block_size = block_size
        self.sampler = sampler
        # On the CPU the host-built tensors are used as they are: no staging, no copies.
        self.uploader: StepUploader | None = None
        self.max_blocks_per_seq = max_blocks_per_seq or int(kv_cache.shape[0])
        if self.device.type != "cpu":
            self.uploader = StepUploader(self.device, self.max_blocks_per_seq, max_num_seqs)
        self.graphs: DecodeGraphs | None = None  # set by capture_cuda_graphs
        self.counters = COUNTERS  # kernel launches, graph replays, eager steps (counters.py)
        # The last sampled batch (its requests, in order) and whether all were plain greedy:
        # a steady batch asks each request once, not every step (Request.plain_greedy never
        # changes; a grammar's matcher may, so that is read every step).
        self._greedy_of: tuple[list[Request], bool] = ([], True)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> bool:
        """Capture decode graphs (cuda_graphs.py) when this model and cache can use them;
        returns whether it did (the reason is logged when not)."""
        reason = DecodeGraphs.supported(self.model, self.kv_cache)
        if reason is not None:
            logger.info("CUDA graphs off: %s", reason)
            return False
        graphs = DecodeGraphs(
            self.model, self.kv_cache, max_num_seqs, self.max_blocks_per_seq, max_model_len
        )
        graphs.capture()
        self.graphs = graphs
        return True

    def forward(self, inputs: BatchInputs) -> torch.Tensor:
        """The step's hidden states: a captured graph's replay for a decode step that fits
        one, else the eager forward pass."""
        if self.graphs is not None:
            size = self.graphs.size_for(inputs.attn, int(inputs.input_ids.shape[0]))
            if size is not None:
                return self.graphs.run(size, inputs.input_ids, inputs.positions, inputs.attn)
        COUNTERS.eager_steps += 1
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn)

    def prepare(
        self,
        chunks: Sequence[ScheduledChunk],
        block_tables: Sequence[list[int]],
        copies: Sequence[tuple[int, int]] = (),
    ) -> StepTensors:
        """Build the step on the host and, on an accelerator, upload it in one copy with the
        block tables taken from the device-resident table (step_upload.py)."""
        inputs = build_batch_inputs(chunks, block_tables, self.block_size, self.kv_cache.shape[0])
        src = dst = rows = None
        if copies:
            src = torch.tensor([s for s, _ in copies], dtype=torch.int64)
            dst = torch.tensor([d for _, d in copies], dtype=torch.int64)
        sampled = [chunk for chunk in chunks if chunk.samples]
        if any(c.forks for c in sampled):
            # logits: [num_sampled_chunks, V] -> [len(requests), V], a leader's row repeated
            rows_of = [i for i, c in enumerate(sampled) for _ in range(1 + len(c.forks))]
            rows = torch.tensor(rows_of, dtype=torch.int64)
        if self.uploader is None:
            return StepTensors(inputs, src, dst, rows)
        optional = [t for t in (src, dst, rows) if t is not None]
        host = [inputs.input_ids, inputs.positions, inputs.logits_indices, *optional]
        ids = [c.request.request_id for c in chunks]
        staged, attn = self.uploader.upload(host, inputs.attn, ids, block_tables)
        extra = iter(staged[3:])
        src, dst, rows = (None if t is None else next(extra) for t in (src, dst, rows))
        return StepTensors(BatchInputs(staged[0], staged[1], attn, staged[2]), src, dst, rows)

    @torch.inference_mode()
    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        block_tables: Sequence[list[int]],
        copies: Sequence[tuple[int, int]] = (),
        feed: Feed | None = None,
    ) -> StepResult:
        """Copy the copy-on-write blocks, compute the chunks' K/V, and sample one token for
        each chunk that ends its request and for each of its forks (same logits row, each
        with its own generator). A request whose sampling fails is reported in `failed`
        rather than failing the step (isolation.py); a failed forward pass raises.

        With `feed` (async scheduling), the input ids of tokens not yet read are written on
        the device first, and the sampled tokens are left there (`StepResult.device_tokens`).
        """
        step = self.prepare(chunks, block_tables, copies)
        if feed is not None:
            feed(step.inputs.input_ids)
        if step.copy_src is not None and step.copy_dst is not None:
            # Before the forward pass: it may write into a copy's source (its last owner).
            self.model.backend.copy_blocks(self.kv_cache, step.copy_src, step.copy_dst)
        inputs = step.inputs
        hidden = self.forward(inputs)
        scored = scored_rows(chunks)  # prompt_logprobs: only requests that ask pay
        scores = score_prompts(scored, hidden, self.model.compute_logits) if scored else ()
        sampled_chunks = [chunk for chunk in chunks if chunk.samples]
        if not sampled_chunks:
            return StepResult.empty(scores)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        requests = [r for c in sampled_chunks for r in (c.request, *c.forks)]
        if step.logits_rows is not None:
            logits = logits[step.logits_rows]
        return self._sample(logits, requests, scores, defer_read=feed is not None)

    def replays_decodes(self, num_seqs: int) -> bool:
        """Whether a pure decode step of `num_seqs` sequences takes `execute_decodes`: on
        an accelerator, with a captured graph that holds it."""
        graphs = self.graphs
        return (
            self.uploader is not None
            and graphs is not None
            and graphs.decode_size(num_seqs) is not None
        )

    @torch.inference_mode()
    def execute_decodes(
        self,
        chunks: Sequence[ScheduledChunk],
        table_of: Callable[[str], list[int]],
        changed: Set[str],
        copies: Sequence[tuple[int, int]] = (),
        feed: Feed | None = None,
        appended: Set[str] = frozenset(),
    ) -> StepResult:
        """`execute` of a pure decode step (every chunk one token that samples, no forks;
        `replays_decodes` True): the inputs built with numpy from the persistent block table
        (only the rows of requests in `changed` read from `table_of`, and the last block of
        those in `appended`: kv_cache_manager's `take_changed`), uploaded in one copy, and a
        graph replayed; no plan, no per-request table, no logits gather. `feed`: as
        `execute`'s."""
        assert self.uploader is not None and self.graphs is not None, "see replays_decodes"
        n = len(chunks)
        size = self.graphs.decode_size(n)
        assert size is not None, "see replays_decodes"
        # Whole-batch passes in C where they can be (map over an item / attribute getter).
        requests: list[Request] = list(map(_REQUEST, chunks))
        if isinstance(feed, FeedEveryRow):
            tokens = np.zeros(n, np.int64)  # each row's input comes from the device
        else:  # a decode's one token is its last (an output, or the prompt's when none)
            last = [(r.output_token_ids or r.prompt_token_ids)[-1] for r in requests]
            tokens = np.array(last, np.int64)
        step, pairs = self.uploader.upload_decodes(
            list(map(_REQUEST_ID, requests)),
            tokens,
            np.fromiter(map(_START, chunks), np.int64, n),
            self.block_size,
            changed,
            table_of,
            copies,
            appended,
        )
        if feed is not None:
            feed(step.input_ids)
        if pairs is not None:
            # Before the forward pass: it may write into a copy's source (its last owner).
            self.model.backend.copy_blocks(self.kv_cache, *pairs)
        hidden = self.graphs.replay(size, *step)
        logits = self.model.compute_logits(hidden)
        return self._sample(logits, requests, (), defer_read=feed is not None)

    def _sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        scores: Sequence[PromptScores],
        *,
        defer_read: bool = False,
    ) -> StepResult:
        """One token for each of `requests` from its row of `logits` [len(requests), V];
        with `defer_read`, left on the device (read later: engine/async_step.py), unless the
        batched sampling raises: then each row is sampled alone and read now."""
        rows: Sequence[SamplingRow]
        if self._plain_greedy_batch(requests):
            rows = GreedyRows(len(requests), lambda i: _sampling_row(requests[i]))
        else:
            rows = [_sampling_row(r) for r in requests]
        if defer_read:
            uniforms = self.sampler.draw_uniforms(rows)
            try:
                tokens, _ = self.sampler.sample_on_device(logits, rows, uniforms)
            except Exception:  # isolation.py's path, with the same draws (a rare step)
                logger.warning("deferred sampling failed; sampling this step at once")
                samples = sample_isolating(self.sampler, logits, rows, requests, uniforms)
            else:
                return StepResult(requests, [], [], [], scores, tokens)
        else:
            samples = sample_isolating(self.sampler, logits, rows, requests)
        failed = [requests[i] for i in samples.failed]
        return StepResult(requests, samples.token_ids, samples.logprobs, failed, scores)

    def _plain_greedy_batch(self, requests: list[Request]) -> bool:
        """Whether every request is plain greedy (`Request.plain_greedy`) with no grammar."""
        batch, greedy = self._greedy_of
        if requests != batch:  # by identity, in C
            greedy = all(map(_PLAIN_GREEDY, requests))
            self._greedy_of = (requests, greedy)
        return greedy and list(map(_MATCHER, requests)).count(None) == len(requests)


def _sampling_row(r: Request) -> SamplingRow:
    # Positional: one row per sampled request per step (SamplingRow's field order).
    return SamplingRow(
        r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.generator,
        r.eos_token_ids, r.matcher, r.num_pending,
    )  # fmt: skip
