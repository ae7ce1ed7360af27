"""The GPU check's bookkeeping: result rows, the time budget, running a part so that its
failure is one FAIL row and never stops the next part, the one final table and the exit code.
No torch here: it must import anywhere."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PASS, FAIL, MISS, SKIP = "PASS", "FAIL", "MISS", "SKIP"  # MISS: works, misses a target
STATUSES = (PASS, FAIL, MISS, SKIP)
COLUMNS = ("part", "check", "status", "value", "target", "note")


@dataclass(frozen=True)
class Row:
    """One line of the final table."""

    part: str
    check: str
    status: str
    value: str = ""
    target: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def cells(self) -> tuple[str, ...]:
        return tuple(str(getattr(self, name)) for name in COLUMNS)


class Deadline:
    """A time slice: `left()` seconds remain; parts stop starting new work when it is spent."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.start = clock()
        self.end = self.start + max(0.0, seconds)

    def left(self) -> float:
        return max(0.0, self.end - self._clock())

    def expired(self) -> bool:
        return self.left() <= 0.0

    def spent(self) -> float:
        return self._clock() - self.start


@dataclass
class Context:
    """What every part sees: the device, the size of the run and what parts share (e.g. the
    copy bandwidth part 2 measures, the model folders part 3 builds, for part 4)."""

    device: str  # "cuda" or "cpu"
    small: bool  # tiny shapes (the CPU self-test)
    work_dir: Path  # scratch space (model folders)
    out_dir: Path | None = None  # $OUT: detail files go here too
    shared: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def log(self, message: str) -> None:
        print(message, flush=True)


Part = Callable[[Context, Deadline], list[Row]]


def last_line(exc: BaseException) -> str:
    """`Type: the error's last line`, short enough for a table cell."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def run_part(name: str, part: Part, ctx: Context, deadline: Deadline) -> list[Row]:
    """Run `part`; an exception becomes a FAIL row (its traceback printed), kept after the rows
    the part had reported. Never raises, but for KeyboardInterrupt."""
    ctx.log(f"\n== part {name} ({deadline.left():.0f} s)")
    try:
        rows = part(ctx, deadline)
    except Exception as exc:
        traceback.print_exc()
        rows = [Row(name, "part raised", FAIL, note=last_line(exc))]
    ctx.log(f"== part {name} done in {deadline.spent():.1f} s")
    return rows


def slices(total_s: float, weights: dict[str, float]) -> dict[str, float]:
    """Each part's share of `total_s` by weight (a part that ends early leaves its rest to the
    parts after it: see run_all)."""
    whole = sum(weights.values())
    return {name: total_s * w / whole for name, w in weights.items()}


def run_all(
    parts: Iterable[tuple[str, float, Part]],
    ctx: Context,
    total_s: float,
    rows: list[Row] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[Row]:
    """Run every part in order, each within its weighted share of what is left of `total_s`
    (so time a part leaves unused goes to the parts after it). Rows are appended to `rows` as
    parts finish (a watchdog can print them), and returned; `ctx.shared["running"]` names
    the part running."""
    planned = list(parts)
    overall = Deadline(total_s, clock)
    rows = [] if rows is None else rows
    for index, (name, weight, part) in enumerate(planned):
        rest = sum(w for _, w, _ in planned[index:])
        share = overall.left() * weight / rest if rest else 0.0
        ctx.shared["running"] = name
        rows.extend(run_part(name, part, ctx, Deadline(share, clock)))
    ctx.shared.pop("running", None)
    return rows


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def format_table(rows: list[Row]) -> str:
    """The final table, aligned for a terminal."""
    lines = _aligned([COLUMNS, *(r.cells() for r in rows)])
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def markdown_table(rows: list[Row]) -> str:
    """The same table in Markdown (pipes in cells escaped)."""

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join(
        [line(COLUMNS), line(tuple("---" for _ in COLUMNS)), *map(line, [r.cells() for r in rows])]
    )


def exit_code(rows: list[Row], *, skips_allowed: bool) -> int:
    """0: all passed; 1: something failed; 3: nothing failed but a target was missed (or, on
    a GPU, a whole part was skipped, which means nothing was checked there)."""
    if any(r.status == FAIL for r in rows):
        return 1
    by_part: dict[str, set[str]] = {}
    for r in rows:
        by_part.setdefault(r.part, set()).add(r.status)
    skipped_part = any(statuses == {SKIP} for statuses in by_part.values())
    if any(r.status == MISS for r in rows) or (skipped_part and not skips_allowed):
        return 3
    return 0 if rows else 1


def summary(rows: list[Row]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n)
