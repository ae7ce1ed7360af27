"""When an engine launches each step and when it reads each step's sampled ids, on a clock
the caller gives: what async scheduling changes (engine/async_step.py). A launch is an eager
forward or a graph replay; a read is the synchronous sampler's one sync (`Sampler.sample`,
which the rig's fake_sampling stands in for) or async scheduling's read of the pinned copy
(`Sampler.read_tokens`). It only watches: the wrapped calls run as they were."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.engine.engine import Engine


@dataclass
class Timeline:
    """(kind, time) of each launch and read, in order."""

    clock: Callable[[], float]
    # Steps launched before the timeline started and read after: their reads come first.
    in_flight: int = 0
    events: list[tuple[str, float]] = field(default_factory=list)

    @classmethod
    def of(cls, engine: Engine, clock: Callable[[], float]) -> Timeline:
        """A timeline of `engine`'s steps from now (a step in flight counted)."""
        overlap = engine.overlap
        return cls(clock, int(overlap is not None and overlap.inflight is not None))

    def mark(self, kind: str) -> None:
        self.events.append((kind, self.clock()))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.events]

    def gaps(self) -> list[float]:
        """For each step k with a later one: the time from the read of step k's ids to the
        launch of step k+1 (the k-th read and the (k+1)-th launch, both in order). Positive:
        the device would idle that long after step k (the synchronous loop); negative: step
        k+1 was launched that long before step k's ids were read (async scheduling)."""
        launches = [t for kind, t in self.events if kind == "launch"]
        reads = [t for kind, t in self.events if kind == "read"][self.in_flight :]
        return [launch - read for read, launch in zip(reads, launches[1:], strict=False)]

    def median_idle_ms(self) -> float:
        """The device's median idle time between two steps, were its steps instantaneous."""
        gaps = self.gaps()
        return max(0.0, statistics.median(gaps)) * 1e3 if gaps else 0.0


def watch(engine: Engine, timeline: Timeline) -> Callable[[], None]:
    """Mark `engine`'s launches and reads on `timeline`; returns what undoes it."""
    runner, sampler = engine.runner, engine.runner.sampler
    undo: list[Callable[[], None]] = []

    def wrap(owner: Any, name: str, kind: str, before: bool) -> None:
        original = getattr(owner, name)
        had_own = name in vars(owner)

        def marked(*args: Any, **kwargs: Any) -> Any:
            if before:
                timeline.mark(kind)
            result = original(*args, **kwargs)
            if not before:
                timeline.mark(kind)
            return result

        setattr(owner, name, marked)
        undo.append(
            (lambda: setattr(owner, name, original)) if had_own else (lambda: delattr(owner, name))
        )

    wrap(runner, "forward", "launch", before=True)
    if runner.graphs is not None:
        wrap(runner.graphs, "replay", "launch", before=True)
    wrap(sampler, "sample", "read", before=False)
    wrap(sampler, "read_tokens", "read", before=False)

    def restore() -> None:
        for step in reversed(undo):
            step()

    return restore
