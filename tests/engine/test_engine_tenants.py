"""Tenants in the real engine (tiny model): an EngineRequest's tenant and weight reach every
sample it runs as, fairness under a full batch changes who runs when but never a token, and
every KV block comes back."""

from __future__ import annotations

from collections import Counter

from kvrelay.common.messages import EngineRequest
from kvrelay.common.sampling_params import SamplingParams
from tests.engine.conftest import EngineFactory, assert_pool_whole, run_to_completion

PROMPTS = [[3 + i, 9, 27 + i, 11, 5 * i + 1, 40] for i in range(6)]


def greedy(tokens: int = 12, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=tokens, ignore_eos=True)


def test_the_samples_of_a_request_carry_its_tenant_and_weight(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add(EngineRequest("r", [5, 6, 7], greedy(n=3), tenant="team-a", weight=2.5))
    [leader] = engine.scheduler.waiting
    forks = engine.scheduler._forks[leader.request_id]
    assert {(s.tenant, s.weight) for s in [leader, *forks]} == {("team-a", 2.5)}
    engine.add_request("plain", [5, 6], greedy())  # the offline API's form: the default tenant
    assert (engine.scheduler.waiting[-1].tenant, engine.scheduler.waiting[-1].weight) == ("", 1.0)
    run_to_completion(engine)
    assert_pool_whole(engine)


def run_with_tenants(
    make_engine: EngineFactory, tenants: list[str]
) -> tuple[dict[str, list[int]], list[int]]:
    """Every prompt, greedy, on an engine that runs 3 sequences at once, request i from
    tenant `tenants[i]` (the first four arrive and run a step before the others). Returns
    each request's tokens, and after each step the most seats any one tenant held."""
    engine = make_engine(max_num_seqs=3, num_blocks=24)
    for i, prompt in enumerate(PROMPTS):
        engine.add(EngineRequest(f"r{i}", prompt, greedy(), tenant=tenants[i]))
        if i == 3:
            engine.step()
    tokens: dict[str, list[int]] = {}
    most_seats: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        seats = Counter(r.tenant for r in engine.scheduler.running)
        most_seats.append(max(seats.values(), default=0))
    assert_pool_whole(engine)
    return tokens, most_seats


def test_fair_scheduling_changes_who_runs_not_the_tokens(make_engine: EngineFactory) -> None:
    alone, seats_alone = run_with_tenants(make_engine, [""] * 6)
    shared, seats_fair = run_with_tenants(make_engine, ["A", "A", "A", "A", "B", "C"])
    assert shared == alone and len(alone) == len(PROMPTS)
    # One tenant: the first three keep the 3 seats (until they end). Three tenants: B and C
    # take a seat each from A at once, preempted A requests recompute to the same tokens.
    assert seats_alone[0] == 3
    assert seats_fair[0] == 1
