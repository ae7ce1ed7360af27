"""The messages that cross processes: worker roles, the request a worker's engine runs, KV
handles, peer metadata, engine stats, worker descriptions and output deltas.

Plain frozen values with no torch import, so a light process (the router, the metrics, the
operator) can read them without loading the engine. Ray moves them between processes; the KV
transfer's wire format is protobuf (proto/kvrelay/v1/kv_transfer.proto).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrelay.common.sampling_params import SamplingParams

# The per-pod environment the operator sets on Ray worker pods (their actors inherit it) and
# on router pods: the contract between kvrelay_operator and the router and workers.
GENERATION_ENV = "KVRELAY_GENERATION"  # the deployment revision's hash (routers: their own)
POD_NAME_ENV = "KVRELAY_POD_NAME"  # the pod's name (downward API metadata.name)
NODE_NAME_ENV = "KVRELAY_NODE_NAME"  # the Kubernetes node's name (spec.nodeName)


class Role(enum.StrEnum):
    """What a worker's engine does with a request.

    A StrEnum, so a role read from a flag, an environment variable or a Ray actor name is
    `Role(text)`, and compares equal to its text.
    """

    PREFILL = "prefill"  # stop after the first token; hold the prompt's blocks under a lease
    DECODE = "decode"  # continue requests prefilled elsewhere (pull, then decode), or whole
    BOTH = "both"  # colocated: prefill and decode in one engine

    @property
    def pool(self) -> str:
        """The pool's name in metrics and dashboards ("colocated" for BOTH)."""
        return "colocated" if self is Role.BOTH else self.value

    @property
    def has_connector(self) -> bool:
        """Whether a worker of this role moves KV blocks (registers a KV connector)."""
        return self is not Role.BOTH


class RequestFailedError(Exception):
    """The engine failed this one request (the others in its batch went on). Its message is
    written for the client: it names what went wrong with the request, never engine internals.
    The router answers it as an internal error of that request alone."""


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The id of sample `index` of a request with `n` samples: the request's own id when
    n == 1. The one id scheme of n > 1 fan-out, in the engine and the router alike."""
    return request_id if n == 1 else f"{request_id}#{index}"


def samples_of(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The one n > 1 fan-out rule, for the router and the engine alike: sample `index` of a
    request is its own request, with id `sample_request_id(request_id, index, n)` and
    parameters `params.for_sample(index)` (n = 1, seed + index). In index order."""
    return [
        (sample_request_id(request_id, index, params.n), params.for_sample(index))
        for index in range(params.n)
    ]


@dataclass(frozen=True)
class KVHandle:
    """A prefilled request's KV, held under a lease by the prefill engine `engine_id`.

    `epoch` identifies that engine's life: a restarted engine has a new one, so a handle
    from before the restart is never read with the new engine's descriptors.
    """

    engine_id: str
    epoch: int
    request_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks, in token order
    num_tokens: int  # tokens whose K/V the blocks hold: the whole prompt
    block_hashes: tuple[bytes, ...]  # chain hashes of the full blocks (block_hash.py)
    first_token_id: int  # the token the prefill sampled
    # Its logprobs as (token id, logprob) pairs, when the request asked for logprobs.
    first_token_logprobs: tuple[tuple[int, float], ...] | None = None
    # The lease's unguessable id: with the deployment's KV secret, the one thing that lets a
    # decode engine read these blocks, once, before the lease expires. Empty: not pullable.
    handle_id: str = field(default="", repr=False)


@dataclass(frozen=True)
class EngineRequest:
    """One request as an engine runs it, built once by its sender (the router's relay, the
    offline LLM) and passed whole: relay -> worker actor (`prefill`, `start`) -> engine loop
    -> `Engine.add`. A new per-request field is added here and read where it is used.

    `kv_handle`: the prompt's KV waits at that prefill engine (a decode worker pulls it).
    `resume_output_token_ids` (n = 1 only): the sequence another engine started goes on after
    these output tokens. `prompt`: the prompt's text, when the caller has it (outputs carry
    it). `priority`: lower runs first within its tenant. `tenant` ("" = the default tenant)
    and `weight` (> 0): whose request it is and that tenant's weight, so the engine shares its
    batch fairly across tenants (engine/fair_share.py); the router fills them from the API key.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    kv_handle: KVHandle | None = None
    resume_output_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    priority: int = 0
    tenant: str = ""
    weight: float = 1.0

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv_handle: KVHandle | None = None,
        resume_output_token_ids: Sequence[int] = (),
        prompt: str | None = None,
        priority: int = 0,
        tenant: str = "",
        weight: float = 1.0,
    ) -> None:
        """Token ids are kept as tuples (a list given is copied, a tuple is not).

        Raises:
            ValueError: `weight` not a finite number > 0.
        """
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"weight must be a finite number > 0, got {weight!r} (tenant {tenant!r}): "
                "fix the tenant's weight in --tenant-limits"
            )
        set_field = object.__setattr__
        set_field(self, "request_id", request_id)
        set_field(self, "prompt_token_ids", tuple(prompt_token_ids))
        set_field(self, "params", params)
        set_field(self, "kv_handle", kv_handle)
        set_field(self, "resume_output_token_ids", tuple(resume_output_token_ids))
        set_field(self, "prompt", prompt)
        set_field(self, "priority", priority)
        set_field(self, "tenant", tenant)
        set_field(self, "weight", float(weight))


@dataclass(frozen=True)
class PullPlan:
    """Which remote blocks a decode engine must fetch, and into which of its own blocks.

    Blocks the decode engine already had in its prefix cache are left out.
    """

    request_id: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.local_block_ids)


@dataclass(frozen=True)
class PeerMetadata:
    """What a decode worker needs to reach a prefill worker's KV tensor.

    `payload` is backend-specific bytes (NIXL agent metadata and memory descriptors, or a gRPC
    address); `engine_id` and `epoch` match the engine's `KVHandle`s, so a handle from an
    earlier life of the peer is refused rather than read with stale descriptors.
    """

    engine_id: str
    epoch: int
    backend: str  # "nixl" | "grpc"
    payload: bytes


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load, for routing and metrics.

    The prefix-cache fields are cumulative counters (0 with prefix caching off):
    `prefix_cache_queries` counts the tokens of every admitted sequence (prompt, plus output
    when a preempted one is recomputed) and `prefix_cache_hits` those of them found cached, as
    vLLM counts them; `prefix_cache_evictions` counts cached blocks whose content was dropped
    to reuse the block. `num_cached_blocks` is a gauge: blocks holding cached content now.
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    num_cached_blocks: int = 0
    # Disaggregation: leases held (prefill role), pulls in flight (decode role), and the
    # cumulative counts of expired leases and of pulls that fell back to recompute.
    num_leases: int = 0
    num_pulling: int = 0
    kv_leases_expired: int = 0
    kv_pull_fallbacks: int = 0
    # Requests failed instead of recomputed (kv_transfer_failure="fail"), cumulative.
    kv_transfer_failures: int = 0
    # Bytes of KV this engine pulled from prefill engines (decode role), cumulative.
    kv_bytes_pulled: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    """What a router needs to know of a worker once: its role, identity, and how it hashes
    prompt blocks (so the router can compute the same prefix-cache keys)."""

    role: Role
    engine_id: str
    epoch: int
    block_size: int
    hash_extra_keys: tuple[str, ...]
    num_blocks: int
    max_model_len: int
    pid: int = 0  # the worker's process, for operators' logs (never sent to clients)
    # Where it runs and what it is, for pairing and draining: the worker's deployment revision
    # (a hash of image, model, engine args and version; "" off Kubernetes; router/revisions.py;
    # the field keeps its wire name, workers of every version send it), its pod and node (the
    # Kubernetes names; the host name and "" off Kubernetes) and its Ray actor name.
    generation: str = ""
    pod: str = ""
    node: str = ""
    name: str = ""


class DrainState(enum.StrEnum):
    """Whether a worker takes new requests: a draining one finishes those it has, no more."""

    SERVING = "serving"
    DRAINING = "draining"


@dataclass(frozen=True)
class WorkerStatus:
    """What a router polls besides the stats: is the engine loop alive, is it draining."""

    alive: bool
    state: DrainState = DrainState.SERVING


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's logprob (vLLM's prompt_logprobs): the token at this position, its
    logprob and rank (1: the most likely) given the tokens before it, and the top k there."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # the top-k (token id, logprob), best first


@dataclass(frozen=True)
class SampleDelta:
    """One sample's news from one engine step: its new tokens, and its finish once it has one."""

    index: int
    start: int  # position of token_ids[0] among the sample's output tokens
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, top-n
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class OutputDelta:
    """What a worker sends for a request after a step: only what is new since the last one.

    Every worker call returns this shape. A prefill worker's last delta carries the
    `kv_handle` (finished is True then, with no finish_reason: the request goes on elsewhere).
    Deltas carry token ids and logprobs only: the router detokenizes.
    """

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    kv_handle: KVHandle | None = None
    # "arrival_time" and, once a token exists, "first_token_time" (time.monotonic() seconds
    # on the worker's clock).
    metrics: dict[str, float] = field(default_factory=dict)
    # With params.prompt_logprobs, once (with the first token): one entry per prompt token
    # from the second on (the first has no context to be scored in).
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass(frozen=True)
class ChannelItem:
    """One entry of a batch on a worker's output channel (worker/output_channels.py): a delta,
    or why the stream ended in failure, for the router's `tag` (its number for one `start`
    call, so a request id run twice on one worker, a recompute, never mixes the two runs'
    outputs).

    `error_kind` when failed: "failed" (the engine failed this request alone, as
    RequestFailedError), "invalid" (the worker refused it, as ValueError), "internal".
    """

    tag: int
    delta: OutputDelta | None = None
    error_kind: str = ""
    error: str = ""
