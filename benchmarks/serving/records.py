"""What the benchmark client measured for one request; filled in by `openai_http`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """One request's client-side timings, in seconds (vLLM's `RequestFuncOutput`).

    ttft: from sending to the first chunk that carries a choice (even an empty text).
    itl: the gaps between consecutive such chunks, in arrival order.
    latency: from sending to the last such chunk (the usage-only chunk is not a token).
    output_tokens: the server's `usage.completion_tokens`, None when it sent no usage.
    """

    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter when sent
    output_tokens: int | None = None
    token_chunks: int = 0  # chunks with a choice: the token count when usage is missing
    max_tokens: int | None = None  # what the request asked for
    finish_reason: str | None = None
    generated_text: str = ""
    error: str = ""
    client_queue_time: float = 0.0  # waiting for a --max-concurrency slot before sending

    @property
    def output_len(self) -> int:
        """Tokens generated: the server's usage if given; else max_tokens when the output
        ended for length (that is what "length" means); else one per streamed chunk, which
        undercounts servers that hold back a partial UTF-8 character and send it with the
        next token (llama.cpp does)."""
        if self.output_tokens:
            return self.output_tokens
        if self.finish_reason == "length" and self.max_tokens:
            return self.max_tokens
        return self.token_chunks
