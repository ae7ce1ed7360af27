"""How pydantic's error locations become OpenAI's `param` (api/http_errors.py): the field path
the client sent, without the union-member tags pydantic adds."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.api.http_errors import _param


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("body", "n"), "n"),
        (("body", "prompt", "str"), "prompt"),
        (("body", "prompt", "list[int]", 2), "prompt.2"),
        (("body", "prompt", "list[list[int]]", 0, 1), "prompt.0.1"),
        (("body", "messages", 0, "role"), "messages.0.role"),
        (("body", "stream_options", "include_usage"), "stream_options.include_usage"),
        (("body",), None),
        ((), None),
    ],
)
def test_param_is_the_field_path(loc: tuple[Any, ...], param: str | None) -> None:
    assert _param(loc) == param
