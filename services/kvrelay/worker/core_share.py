"""P/D workers sharing a few cores size each engine step's OpenMP team to the cores their
partners leave idle: a prefill worker runs a lone prompt on all of them while the decode
worker has nothing running, and on its own share while it has.

`kvrelay serve` splits a small machine's cores between its workers (2 cores: 1 thread each),
so a lone 128-token prefill ran on one core while the other sat idle: 162 ms offline against
105 ms on both (2-core EPYC, bf16). The workers publish the threads they run on a board (a
tiny shared file, one slot per worker, `/dev/shm`); before each step a prefill worker takes
its share plus what the others leave free. Decode and colocated workers never borrow: a
decode worker that woke to find the cores lent would stall a 2-thread team at every barrier
(a descheduled team thread is the colocated collapse), so only the worker whose steps are
long and rare borrows, and it gives the cores back at its next step.

A borrower borrows only while nothing else runs on the machine (/proc/stat's procs_running).
On such a machine a colocated worker's team threads spin only briefly at a barrier before
they sleep (WAIT_ENV): a thread spinning long holds a core that the thread it waits for
(descheduled by any other process) needs, and one that sleeps at once pays a wake-up at every
parallel region. $KVRELAY_CORE_SHARE turns both off.

This module sizes teams and keeps the board; it does not start workers or read the engine.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from kvrelay.common.env import CORE_BOARD, CORE_SHARE

logger = logging.getLogger(__name__)

# At or below this many cores `auto` shares them (`kvrelay serve` splits them between its
# workers, so a lone prefill runs on a fraction of a machine that is idle otherwise). Measured
# on 2 cores only (benchmarks/results/2026-12-05_serve_compare_epyc_cores.md).
SMALL_MACHINE_CORES = 4
CHOICES = ("auto", "on", "off")
SLOTS = 64  # workers on one board; a worker finding none free runs its share (and says so)
# A slot: the worker's pid (0: free) and the threads it runs now (0: idle).
_SLOT = struct.Struct("<iI")
BOARD_BYTES = SLOTS * _SLOT.size
BORROWER_ROLES = ("prefill",)
# A colocated team thread waiting at a barrier spins 1,000 times (~15 us here) before it
# sleeps, not libgomp's default 300,000 (milliseconds): long enough to catch the next parallel
# region of a forward pass, short enough that a thread whose partner was descheduled (another
# process took the core) soon lets that partner run. A 128-token bf16 prefill on 2 threads
# (2-core EPYC, 2026-12-05): quiet 84 ms with 1,000 spins, 94 sleeping at once
# (OMP_WAIT_POLICY=PASSIVE, each region's wake-up paid), 92 with the default; beside a busy
# process 177 / 164 / 432 ms. Served at 1 stream, colocated: TTFT p50 95-105 ms against
# 103-108 sleeping at once, output 78-82 tok/s against 59-62. P/D workers keep the default
# spin: its prefill worker borrows only cores nothing else runs on (with 1,000 spins its
# served TTFT was 119-139 ms against 102-123). libgomp reads it once, as it loads: set before
# Ray starts.
WAIT_ENV = {"GOMP_SPINCOUNT": "1000"}
OPENMP_WAIT_NAMES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
Env = Mapping[str, str] | None


def team_size(share: int, cores: int, others: int, *, borrows: bool) -> int:
    """Threads for a worker's next step.

    Args:
        share: the threads the worker was given (`--worker-threads`, or cores // workers).
        cores: the cores its workers share.
        others: the threads the other workers on the board run now (idle ones publish 0).
        borrows: whether this worker may take idle cores (prefill workers only).

    A borrower gets its share plus whatever the others leave of `cores`, never less than its
    share (the others are over theirs only for the step in which one of them wakes).
    """
    if share < 1 or cores < 1 or others < 0:
        raise ValueError(f"team_size: share {share}, cores {cores}, others {others}")
    if not borrows:
        return share
    return max(share, cores - others)


def sharing_enabled(choice: str, cores: int, workers: int, colocated: bool) -> bool:
    """Whether `kvrelay serve` gives its workers a board: `on`, or `auto` on a machine of at
    most SMALL_MACHINE_CORES cores running P/D (colocated has no partner to lend it cores)."""
    if choice == "off" or colocated or workers < 2:
        return False
    return core_share_applies(choice, cores)


def core_share_applies(choice: str, cores: int) -> bool:
    """Whether $KVRELAY_CORE_SHARE (`choice`) applies on a machine of `cores` cores: `on`, or
    `auto` on one of at most SMALL_MACHINE_CORES cores, where any other process takes a core a
    team thread needs (P/D's prefill worker ran a lone prompt on a fraction of an idle
    machine; a colocated 2-thread team spinning libgomp's default stalled at every barrier)."""
    if choice not in CHOICES:
        raise ValueError(f"{CORE_SHARE.name}={choice!r}: use one of {', '.join(CHOICES)}")
    return choice == "on" or (choice == "auto" and cores <= SMALL_MACHINE_CORES)


@dataclass(frozen=True)
class ServeCores:
    """How `kvrelay serve` has its workers use the cores."""

    board: bool  # P/D workers size each step's team on a board they share
    # Colocated: OpenMP team threads spin briefly at a barrier, then sleep (WAIT_ENV). Not
    # P/D: its prefill worker borrows only cores nothing else runs on, and served faster
    # with libgomp's default spin (see WAIT_ENV).
    short_spin: bool

    @classmethod
    def decide(
        cls, cores: int, workers: int, colocated: bool, joins_cluster: bool, environ: Env = None
    ) -> ServeCores:
        """From $KVRELAY_CORE_SHARE; nothing where serve joins a Ray cluster (its workers do
        not inherit serve's environment there, nor need to share its machine)."""
        choice = CORE_SHARE.get(environ) or CORE_SHARE.default
        if joins_cluster:
            core_share_applies(choice, cores)  # a bad value is refused all the same
            return cls(board=False, short_spin=False)
        return cls(
            board=sharing_enabled(choice, cores, workers, colocated),
            short_spin=core_share_applies(choice, cores) and colocated,
        )


class CoreBoard:
    """The shared file: one `_SLOT` per worker. A slot's two fields are each written with one
    aligned 4-byte store, so a reader sees a slot's old value or its new one, never a mix."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != BOARD_BYTES:
                raise ValueError(
                    f"{path} is not a core board ({BOARD_BYTES} bytes): unset {CORE_BOARD.name}"
                )
            self._map = mmap.mmap(fd, BOARD_BYTES)
        finally:
            os.close(fd)

    @staticmethod
    def create(directory: Path | None = None) -> Path:
        """A new empty board file (the caller removes it when its workers are gone)."""
        where = directory or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
        fd, name = tempfile.mkstemp(prefix="kvrelay-cores-", dir=where)
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(BOARD_BYTES))
        return Path(name)

    def claim(self, pid: int) -> int | None:
        """A free slot (or a dead process's) for `pid`, marked idle; None when all are taken."""
        with open(self.path, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # claims are rare; publishing takes no lock
            for slot in range(SLOTS):
                owner, _ = _SLOT.unpack_from(self._map, slot * _SLOT.size)
                if owner in (0, pid) or not _alive(owner):
                    _SLOT.pack_into(self._map, slot * _SLOT.size, pid, 0)
                    return slot
        return None

    def release(self, slot: int) -> None:
        _SLOT.pack_into(self._map, slot * _SLOT.size, 0, 0)

    def publish(self, slot: int, threads: int) -> None:
        struct.pack_into("<I", self._map, slot * _SLOT.size + 4, threads)

    def others(self, slot: int) -> int:
        """The threads every other claimed slot runs now."""
        total = 0
        for other, (owner, threads) in enumerate(_SLOT.iter_unpack(self._map)):
            if other != slot and owner:
                total += threads
        return total


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, alive
    return True


class StepThreads:
    """One worker's seat on a board: the engine loop calls `before_step` before each step
    and `idle` when a step leaves nothing to run; both on the loop thread, whose OpenMP team
    runs the steps (torch.set_num_threads sets the calling thread's team, ~10 us)."""

    def __init__(
        self,
        board: CoreBoard,
        slot: int,
        share: int,
        cores: int,
        borrows: bool,
        running_elsewhere: Callable[[], int] | None = None,
    ):
        """`running_elsewhere`: how many threads outside this one run now (default: the
        machine's, `running_besides_caller`); a borrower asks it before it borrows."""
        self.board, self.slot = board, slot
        self.share, self.cores, self.borrows = share, cores, borrows
        self.running_elsewhere = running_elsewhere or running_besides_caller
        self.threads = share  # the team size set last (the engine was built with `share`)
        self._published = 0

    def before_step(self) -> int:
        """Set this step's team size and publish it; returns it.

        A borrower takes the cores its partners leave idle only where nothing else runs on
        them now: any other process (a build, a test, the client) would deschedule one of its
        team's threads mid-step, and the team waits for that thread at every barrier (a
        128-token prefill beside a busy process: 3.4 s on 2 threads, 0.34 s on 1, load 4)."""
        others = self.board.others(self.slot)
        threads = team_size(self.share, self.cores, others, borrows=self.borrows)
        if threads > self.share:
            # Our own team's threads beyond this one may still spin after the last step.
            elsewhere = max(0, self.running_elsewhere() - (self.threads - 1))
            threads = team_size(self.share, self.cores, others + elsewhere, borrows=True)
        if threads != self.threads:
            import torch  # here: `kvrelay serve` imports this module for `serve_board`

            torch.set_num_threads(threads)
            self.threads = threads
        self._publish(threads)
        return threads

    def idle(self) -> None:
        """Nothing runs here now: publish 0, so a borrower may take these cores."""
        self._publish(0)

    def close(self) -> None:
        self.board.release(self.slot)

    def _publish(self, threads: int) -> None:
        if threads != self._published:
            self.board.publish(self.slot, threads)
            self._published = threads


def running_besides_caller(samples: int = 3, gap_s: float = 0.0003) -> int:
    """Threads running or waiting for a core on this machine now, besides the caller: the
    fewest of `samples` reads of /proc/stat's procs_running, `gap_s` apart (a thread that
    just handed us the request is gone by the next read; a busy process is in every one)."""
    fewest = None
    for i in range(samples):
        if i:
            time.sleep(gap_s)
        running = _procs_running()
        fewest = running if fewest is None else min(fewest, running)
        if fewest <= 1:
            break  # only the caller: no later read can show fewer (a quiet check, one read)
    return max(0, (fewest or 1) - 1)


def _procs_running() -> int:
    with open("/proc/stat", "rb") as stat:
        for line in stat:
            if line.startswith(b"procs_running "):
                return int(line.split()[1])
    raise RuntimeError("/proc/stat has no procs_running line: not Linux?")


def step_threads_from_env(
    role: str, share: int, environ: Mapping[str, str] | None = None
) -> StepThreads | None:
    """This worker's seat on the board `kvrelay serve` named in $KVRELAY_CORE_BOARD, or None
    (no board: the worker keeps `share` threads for every step)."""
    path = CORE_BOARD.get(environ)
    if not path:
        return None
    try:
        board = CoreBoard(Path(path))
    except FileNotFoundError:
        logger.warning("%s=%s is gone: %d thread(s) per step", CORE_BOARD.name, path, share)
        return None
    slot = board.claim(os.getpid())
    if slot is None:
        logger.warning("core board %s is full: %d thread(s) per step", path, share)
        return None
    cores = len(os.sched_getaffinity(0))
    return StepThreads(board, slot, share, cores, borrows=role in BORROWER_ROLES)


@contextlib.contextmanager
def serve_board(
    plan: ServeCores, environ: MutableMapping[str, str] | None = None
) -> Iterator[Path | None]:
    """For `kvrelay serve`, as `plan` says: a board for its workers, named in
    $KVRELAY_CORE_BOARD, and WAIT_ENV unless the environment sets an OpenMP wait of its own;
    set before Ray starts (the raylet passes its environment on to the workers it starts) and
    taken back on exit, when the board is removed. Yields the board's path, or None."""
    environ = os.environ if environ is None else environ
    path = CoreBoard.create() if plan.board else None
    added = {CORE_BOARD.name: str(path)} if path is not None else {}
    if plan.short_spin and not any(name in environ for name in OPENMP_WAIT_NAMES):
        added.update(WAIT_ENV)  # a setting of theirs stays
    environ.update(added)
    try:
        yield path
    finally:
        for name in added:
            environ.pop(name, None)
        if path is not None:
            path.unlink(missing_ok=True)
