"""chat_template_kwargs (vLLM's field): extra variables for the model's chat template, such as
Qwen3's `enable_thinking`. Checked here, rendered by prompt_encoder.

A key that names one of `apply_chat_template`'s own parameters would change how the template is
called rather than what it sees (`tokenize`, `chat_template`, `tools`, ...): those are refused,
as are keys that are not identifiers (a template cannot read them). Values must be JSON, which
they are by the time they arrive; their total size is bounded like any other text we render.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvrelay.router.request_errors import InvalidRequestError

FIELD = "chat_template_kwargs"
# apply_chat_template's parameters and the names the template's renderer sets itself.
RESERVED = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize", "padding",
        "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
        "strftime_now",
    }
)  # fmt: skip
MAX_KWARGS_CHARS = 64 * 1024


def template_kwargs(raw: Any) -> dict[str, Any]:
    """The checked variables ({} when none were sent).

    Raises:
        InvalidRequestError: not an object, a reserved or non-identifier key (named
            `chat_template_kwargs.KEY`), or more than MAX_KWARGS_CHARS of JSON.
    """
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InvalidRequestError(f"{FIELD} must be an object of template variables", FIELD)
    for key in raw:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidRequestError(
                f"{FIELD} keys must be template variable names, got {key!r}", FIELD
            )
        if key in RESERVED:
            raise InvalidRequestError(
                f"{FIELD}.{key} is a parameter of the chat template call, not a variable: "
                "use the request's own field",
                f"{FIELD}.{key}",
            )
    if len(json.dumps(raw, ensure_ascii=False)) > MAX_KWARGS_CHARS:
        raise InvalidRequestError(f"{FIELD} is longer than {MAX_KWARGS_CHARS} characters", FIELD)
    return dict(raw)
