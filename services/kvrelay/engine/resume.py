"""A sequence resumed from another engine's outputs (a worker that died mid-stream): the
outputs checked, taken over, detokenized and the seeded draws skipped, so the tokens that
follow are the ones the first engine would have produced. It never schedules anything."""

from __future__ import annotations

from kvrelay.common.messages import EngineRequest
from kvrelay.common.sampling_params import check_vocab
from kvrelay.engine.parent_request import ParentRequest
from kvrelay.engine.request import Request
from kvrelay.engine.sampler import skip_seeded_draws


def check_resume(request: EngineRequest, vocab_size: int, max_total_tokens: int) -> list[int]:
    """`request.resume_output_token_ids` as ints, checked.

    Raises:
        ValueError: n != 1, a token outside the vocabulary, nothing left to generate
            (max_tokens), or a prompt and outputs that fill the context.
    """
    outputs = [int(t) for t in request.resume_output_token_ids]
    if not outputs:
        return outputs
    params = request.params
    if params.n != 1:
        raise ValueError("resume_output_token_ids needs n = 1")
    check_vocab("resume_output_token_ids", outputs, vocab_size)
    if params.max_tokens is not None and len(outputs) >= params.max_tokens:
        raise ValueError("resume_output_token_ids leaves nothing to generate (max_tokens)")
    if len(request.prompt_token_ids) + len(outputs) >= max_total_tokens:
        raise ValueError("the prompt and resume_output_token_ids fill the context")
    return outputs


def resume(request: Request, outputs: list[int], parent: ParentRequest, index: int) -> None:
    """`request` (sample `index` of `parent`) takes over `outputs`."""
    request.resume(outputs)
    for token_id in outputs:
        parent.detokenize(index, token_id)  # the text so far; a stop was checked there
    if request.generator is not None and not request.sampling_params.is_greedy:
        skip_seeded_draws(request.generator, len(outputs))
