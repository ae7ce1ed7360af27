"""The grammar's mask in the sampler: bits unpacked on the logits' device exactly, only the
constrained rows touched, every sampling mode kept inside the grammar, one row or many (the
parallel fill), the min_tokens rule at the grammar's end, and a failing neighbour isolated."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.structured_outputs import StructuredKind, StructuredOutputs
from kvrelay.engine.grammar import GrammarCompiler
from kvrelay.engine.grammar_mask import _refuse_if_not_all, apply_bitmask, masked_logits
from kvrelay.engine.isolation import sample_isolating
from kvrelay.engine.request import Request
from kvrelay.engine.sampler import Sampler, SamplingRow
from tests.engine.conftest import TINY_VOCAB
from tests.engine.grammar_vocab import EOS, allowed_tokens, write_tokenizer

GREEDY = SamplingParams(temperature=0.0)
REGEX = StructuredOutputs(StructuredKind.REGEX, "[0-9]+(px|em)")


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrammarCompiler]:
    folder = tmp_path_factory.mktemp("vocab")
    write_tokenizer(folder)
    compiler = GrammarCompiler(str(folder), TINY_VOCAB, (EOS,))
    yield compiler
    compiler.shutdown()


def matcher(compiler: GrammarCompiler, constraint: StructuredOutputs = REGEX) -> Any:
    return compiler.compile(constraint).result().deep_copy()


def row(params: SamplingParams, m: Any = None, outputs: Sequence[int] = ()) -> SamplingRow:
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, [5, 6], list(outputs), generator, (EOS,), m)


def reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] bool, bit by bit in Python."""
    words = bitmask.tolist()
    return torch.tensor([[(w[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)] for w in words])


@pytest.mark.parametrize("vocab", [32, 100, 128])
def test_apply_bitmask_unpacks_every_bit(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (3, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, 0] = -(2**31)  # only bit 31: the sign bit
    x = torch.randn(3, vocab, generator=gen)
    expected = x.masked_fill(~reference_allowed(bitmask, vocab), float("-inf"))
    apply_bitmask(x, bitmask)
    assert torch.equal(x, expected)
    assert x[0, 31] > float("-inf") and (x[0, :31] == float("-inf")).all()


def test_only_the_constrained_rows_change_and_the_input_is_untouched(
    compiler: GrammarCompiler,
) -> None:
    logits = torch.randn(3, TINY_VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    m = matcher(compiler)
    rows = [row(GREEDY), row(GREEDY, m), row(GREEDY)]
    x = masked_logits(logits, rows, [1])
    assert torch.equal(logits, before)
    assert torch.equal(x[0], logits[0]) and torch.equal(x[2], logits[2])
    allowed = allowed_tokens(m, TINY_VOCAB)
    digits = {3 + ord(d) - 32 for d in "0123456789"}
    assert digits <= allowed and len(allowed - digits) <= 1  # and the merge "12"
    finite = {t for t in range(TINY_VOCAB) if x[1, t] > float("-inf")}
    assert finite == allowed
    assert torch.equal(x[1, sorted(allowed)], logits[1, sorted(allowed)])


def test_every_sampling_mode_stays_inside_the_grammar(compiler: GrammarCompiler) -> None:
    sampler = Sampler(torch.Generator().manual_seed(0))
    modes = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, seed=1),
        SamplingParams(temperature=1.0, top_k=3, top_p=0.8, seed=2),
        SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.5, seed=3),
        SamplingParams(temperature=1.0, logit_bias={EOS: 100.0, 50: 100.0}, logprobs=4),
    ]
    gen = torch.Generator().manual_seed(1)
    for step in range(20):
        matchers = [matcher(compiler) for _ in modes]
        rows = [row(p, m) for p, m in zip(modes, matchers, strict=True)]
        logits = torch.randn(len(rows), TINY_VOCAB, generator=gen) * 5
        out = sampler(logits, rows)
        for i, token in enumerate(out.token_ids):
            assert token in allowed_tokens(matchers[i], TINY_VOCAB), (step, i)
        lp = out.logprobs[4]
        assert lp is not None and lp.token_logprob > float("-inf")
        assert all(t in allowed_tokens(matchers[4], TINY_VOCAB) for t, v in lp.top if v > -1e30)


def test_several_rows_fill_in_parallel_as_one_row_does(compiler: GrammarCompiler) -> None:
    constraints = [
        REGEX,
        StructuredOutputs.choice(["yes", "no"]),
        StructuredOutputs(StructuredKind.JSON_OBJECT),
    ]
    matchers = [matcher(compiler, c) for c in constraints]
    assert matchers[0].consume_token(3 + ord("4") - 32)
    rows = [row(GREEDY, m) for m in matchers]
    logits = torch.randn(3, TINY_VOCAB, generator=torch.Generator().manual_seed(2))
    together = masked_logits(logits, rows, [0, 1, 2])
    for i in range(3):
        alone = masked_logits(logits[i : i + 1], rows[i : i + 1], [0])
        assert torch.equal(together[i : i + 1], alone)


def test_min_tokens_refuses_eos_unless_it_is_all_the_grammar_allows(
    compiler: GrammarCompiler,
) -> None:
    words = torch.zeros(4, dtype=torch.int32)
    words[0] = 1 << EOS
    _refuse_if_not_all(words, (EOS,))
    assert int(words[0]) == 1 << EOS  # the grammar's end: EOS stays
    words[1] = 1 << 3  # token 35 too
    _refuse_if_not_all(words, (EOS, 127, 10**6))
    assert int(words[0]) == 0 and int(words[1]) == 1 << 3
    # Through the sampler: "ab*" after "a" allows "b" or the end.
    sampler = Sampler()
    a, b = 3 + ord("a") - 32, 3 + ord("b") - 32
    pushed = SamplingParams(temperature=0.0, logit_bias={EOS: 100.0}, min_tokens=3)
    logits = torch.zeros(1, TINY_VOCAB)
    for outputs, expected in (([a], b), ([a, b, b], EOS)):
        m = matcher(compiler, StructuredOutputs(StructuredKind.REGEX, "ab*"))
        for token in outputs:
            assert m.consume_token(token)
        assert sampler(logits, [row(pushed, m, outputs)]).token_ids == [expected]
    # A complete grammar allows EOS alone: min_tokens gives way.
    m = matcher(compiler, StructuredOutputs(StructuredKind.REGEX, "a"))
    assert m.consume_token(a)
    assert sampler(logits, [row(dataclasses.replace(pushed, logit_bias=()), m, [a])]).token_ids == [
        EOS
    ]


def test_a_failing_neighbour_leaves_the_constrained_row_its_token(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Isolation re-samples each row alone with its drawn uniform: the constrained row's
    mask is filled again from the same (unadvanced) matcher, so its token is the same."""
    seeded = SamplingParams(temperature=1.0, seed=9)
    logits = torch.randn(2, TINY_VOCAB, generator=torch.Generator().manual_seed(3))
    clean = Sampler()(logits[:1], [row(seeded, matcher(compiler))]).token_ids[0]
    original = Sampler._sample

    def faulty(x: torch.Tensor, rows: Sequence[SamplingRow], u: torch.Tensor) -> torch.Tensor:
        if any(r.params.top_k == 77 for r in rows):
            raise RuntimeError("injected sampling fault")
        return original(x, rows, u)

    monkeypatch.setattr(Sampler, "_sample", staticmethod(faulty))
    bad = dataclasses.replace(seeded, top_k=77, seed=None)
    rows = [row(seeded, matcher(compiler)), row(bad)]
    requests = [Request(str(i), [5, 6], r.params, 64) for i, r in enumerate(rows)]
    result = sample_isolating(Sampler(), logits, rows, requests)
    assert result.failed == [1] and result.token_ids[0] == clean


def test_an_unconstrained_batch_never_builds_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvrelay.engine.sampler as sampler_module

    def refuse(*args: Any) -> torch.Tensor:
        raise AssertionError("masked an unconstrained batch")

    monkeypatch.setattr(sampler_module, "masked_logits", refuse)
    rows = [row(GREEDY), row(SamplingParams(temperature=1.0, seed=1, min_tokens=2))]
    assert len(Sampler()(torch.randn(2, TINY_VOCAB), rows).token_ids) == 2


def test_the_compiler_reports_llguidances_reason(compiler: GrammarCompiler, tmp_path: Path) -> None:
    from kvrelay.common.grammar import GrammarError

    bad = StructuredOutputs(StructuredKind.REGEX, "(unclosed")
    with pytest.raises(GrammarError) as error:
        compiler.compile(bad).result()
    assert str(error.value) and "\n" not in str(error.value)
    assert compiler.compile(bad).exception() is error.value  # cached, not compiled again
    none = GrammarCompiler(str(tmp_path), TINY_VOCAB, (EOS,))
    with pytest.raises(GrammarError, match="no tokenizer"):
        none.compile(REGEX).result()
    none.shutdown()
