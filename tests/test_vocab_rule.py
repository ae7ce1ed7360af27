"""The one vocabulary rule (kvrelay.common.sampling_params.check_vocab): the router refuses
with it before admission, the engine with it on entry; both name the field and the id."""

from __future__ import annotations

import pytest

from kvrelay.common.sampling_params import check_vocab
from kvrelay.engine.request import validate_prompt


def test_ids_inside_the_vocabulary_pass() -> None:
    check_vocab("prompt", [0, 5, 9], 10)
    check_vocab("logit_bias", [], 10)


@pytest.mark.parametrize("bad", [10, -1])
def test_the_first_id_outside_is_named_with_its_field(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"^logit_bias: token id {bad} is outside .*\[0, 10\)"):
        check_vocab("logit_bias", [3, bad, 11], 10)


def test_the_engine_entry_check_uses_the_same_rule() -> None:
    with pytest.raises(ValueError, match=r"^prompt: token id 12 is outside the vocabulary"):
        validate_prompt([1, 12], vocab_size=10, max_model_len=64, kv_capacity=64)
