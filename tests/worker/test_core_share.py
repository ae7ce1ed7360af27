"""worker/core_share.py: the team-size rule, the board two processes really share through
/dev/shm (or a temporary folder), the seat the engine loop sizes its steps by, and what
`kvrelay serve` decides from $KVRELAY_CORE_SHARE."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvrelay.common.env import CORE_BOARD, CORE_SHARE
from kvrelay.common.messages import EngineRequest
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.worker.core_share import (
    BOARD_BYTES,
    SLOTS,
    CoreBoard,
    ServeCores,
    StepThreads,
    core_share_applies,
    running_besides_caller,
    serve_board,
    sharing_enabled,
    step_threads_from_env,
    team_size,
)
from kvrelay.worker.deltas import request_deltas
from kvrelay.worker.engine_loop import EngineLoop
from tests.engine.conftest import EngineFactory


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    """A seat sets torch's thread count (global as well as the caller's): restore it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def board_path(tmp_path: Path) -> Path:
    return CoreBoard.create(tmp_path)


# -- the rule --


def test_a_prefill_worker_borrows_the_cores_its_partners_leave_idle() -> None:
    assert team_size(1, 2, others=0, borrows=True) == 2  # the decode worker idle
    assert team_size(1, 2, others=1, borrows=True) == 1  # it runs its one thread
    assert team_size(1, 4, others=1, borrows=True) == 3
    assert team_size(2, 4, others=3, borrows=True) == 2  # never under its share
    assert team_size(1, 2, others=2, borrows=True) == 1


def test_a_worker_that_does_not_borrow_keeps_its_share() -> None:
    for others in (0, 1, 5):
        assert team_size(1, 2, others=others, borrows=False) == 1
        assert team_size(3, 8, others=others, borrows=False) == 3


@pytest.mark.parametrize(("share", "cores", "others"), [(0, 2, 0), (1, 0, 0), (1, 2, -1)])
def test_a_nonsense_size_is_refused(share: int, cores: int, others: int) -> None:
    with pytest.raises(ValueError, match="team_size"):
        team_size(share, cores, others, borrows=True)


def test_auto_shares_a_small_machines_cores_between_p_and_d_only() -> None:
    assert sharing_enabled("auto", cores=2, workers=2, colocated=False)
    assert sharing_enabled("auto", cores=4, workers=3, colocated=False)
    assert not sharing_enabled("auto", cores=8, workers=2, colocated=False)  # not measured
    assert sharing_enabled("on", cores=8, workers=2, colocated=False)
    assert not sharing_enabled("off", cores=2, workers=2, colocated=False)
    assert not sharing_enabled("on", cores=2, workers=1, colocated=True)  # no partner
    assert not sharing_enabled("auto", cores=2, workers=2, colocated=True)


def test_a_bad_choice_names_the_variable() -> None:
    with pytest.raises(ValueError, match="KVRELAY_CORE_SHARE='yes': use one of auto, on, off"):
        sharing_enabled("yes", cores=2, workers=2, colocated=False)


def test_serve_shares_only_with_workers_of_its_own_ray() -> None:
    environ: dict[str, str] = {}
    decide = ServeCores.decide
    assert decide(2, 2, False, joins_cluster=False, environ=environ) == ServeCores(True, False)
    assert decide(2, 2, False, joins_cluster=True, environ=environ) == ServeCores(False, False)
    environ[CORE_SHARE.name] = ""  # empty reads as the default
    assert decide(2, 2, False, joins_cluster=False, environ=environ) == ServeCores(True, False)
    environ[CORE_SHARE.name] = "off"
    assert decide(2, 2, False, joins_cluster=False, environ=environ) == ServeCores(False, False)
    environ[CORE_SHARE.name] = "always"
    for joins in (False, True):
        with pytest.raises(ValueError, match="KVRELAY_CORE_SHARE='always'"):
            decide(2, 2, False, joins_cluster=joins, environ=environ)


def test_colocated_on_a_small_machine_gets_the_short_spin_only() -> None:
    """No partner to lend it cores, but its 2-thread team is the one that stalled."""
    assert ServeCores.decide(2, 1, True, False, {}) == ServeCores(board=False, short_spin=True)
    assert ServeCores.decide(8, 1, True, False, {}) == ServeCores(board=False, short_spin=False)
    on = {CORE_SHARE.name: "on"}
    assert ServeCores.decide(8, 1, True, False, on) == ServeCores(board=False, short_spin=True)
    assert ServeCores.decide(8, 2, False, False, on) == ServeCores(board=True, short_spin=False)
    assert ServeCores.decide(2, 1, True, False, {CORE_SHARE.name: "off"}) == ServeCores(
        False, False
    )
    assert core_share_applies("auto", 4) and not core_share_applies("auto", 5)
    assert not core_share_applies("off", 2)


# -- the board --


def test_workers_see_each_others_threads(board_path: Path) -> None:
    prefill, decode = CoreBoard(board_path), CoreBoard(board_path)
    mine = prefill.claim(os.getpid())
    # A second claim by the same pid (a worker re-seated) takes the same slot back.
    assert mine == 0 and prefill.claim(os.getpid()) == 0
    theirs = decode.claim(os.getppid())  # the partner: another live process
    assert theirs == 1
    assert prefill.others(mine) == 0  # both idle
    decode.publish(theirs, 1)
    assert prefill.others(mine) == 1 and decode.others(theirs) == 0
    prefill.publish(mine, 2)
    assert decode.others(theirs) == 2
    decode.release(theirs)
    assert prefill.others(mine) == 0


def test_a_dead_workers_slot_is_taken_again(board_path: Path) -> None:
    board = CoreBoard(board_path)
    gone = _dead_pid()
    assert board.claim(gone) == 0
    board.publish(0, 1)
    assert board.claim(os.getpid()) == 0  # its owner is dead: reclaimed, idle
    assert board.others(1) == 0


def test_a_full_board_gives_no_slot(board_path: Path) -> None:
    board_path.write_bytes(struct.pack("<iI", 1, 0) * SLOTS)  # every slot held by pid 1
    assert CoreBoard(board_path).claim(os.getpid()) is None


def test_another_process_publishes_through_the_shared_file(board_path: Path) -> None:
    """The decode worker in another process: its slot's value reaches ours."""
    board = CoreBoard(board_path)
    mine = board.claim(os.getpid())
    assert mine is not None
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from kvrelay.worker.core_share import CoreBoard\n"
        "b = CoreBoard(Path(sys.argv[1]))\n"
        "slot = b.claim(os.getppid() + 100000)\n"  # a pid no process has
        "b.publish(slot, 3)\n"
        "print(slot)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(board_path)], capture_output=True, text=True, check=True
    )
    assert int(out.stdout) == 1
    assert board.others(mine) == 3


def test_a_file_of_another_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x"
    path.write_bytes(bytes(BOARD_BYTES - 1))
    with pytest.raises(ValueError, match=r"not a core board.*unset KVRELAY_CORE_BOARD"):
        CoreBoard(path)


# -- the seat --


def test_a_prefill_seat_sizes_the_loop_threads_team(board_path: Path) -> None:
    """On its own thread, as the engine loop runs it: 2 threads with the partner idle, 1
    once it publishes its thread, 2 again when it goes idle; the seat publishes its own."""
    partner = CoreBoard(board_path)
    partner_slot = partner.claim(os.getppid())  # another live process
    assert partner_slot is not None
    seen: list[tuple[int, int, int]] = []

    def loop_thread() -> None:
        seat = step_threads_from_env("prefill", 1, {CORE_BOARD.name: str(board_path)})
        assert seat is not None and seat.borrows
        seat.cores = 2  # this test's machine may have more
        seat.running_elsewhere = lambda: 0  # and other processes: the machine's own below
        for partner_threads in (0, 1, 0):
            partner.publish(partner_slot, partner_threads)
            team = seat.before_step()
            seen.append((team, torch.get_num_threads(), partner.others(partner_slot)))
        seat.idle()
        seen.append((0, 0, partner.others(partner_slot)))
        seat.close()

    thread = threading.Thread(target=loop_thread)
    thread.start()
    thread.join()
    assert seen == [(2, 2, 2), (1, 1, 1), (2, 2, 2), (0, 0, 0)]


def test_a_decode_seat_keeps_its_share_and_publishes_while_busy(board_path: Path) -> None:
    seat = step_threads_from_env("decode", 1, {CORE_BOARD.name: str(board_path)})
    assert seat is not None and not seat.borrows
    other = CoreBoard(board_path)
    assert seat.before_step() == 1 and other.others(-1) == 1
    seat.idle()
    assert other.others(-1) == 0


def test_a_borrower_leaves_the_cores_to_another_process_that_runs(board_path: Path) -> None:
    running = [1]
    seat = StepThreads(CoreBoard(board_path), 0, 1, 4, True, running_elsewhere=lambda: running[0])
    try:
        assert seat.before_step() == 3  # 4 cores, its partners idle, one other process runs
        # Its own second and third threads may still spin from that step: not counted.
        running[0] = 3
        assert seat.before_step() == 3
        running[0] = 4  # one more than its own: one core less
        assert seat.before_step() == 2
        running[0] = 9
        assert seat.before_step() == 1  # never under its share
    finally:
        seat.close()


def test_the_machines_running_threads_include_a_busy_process() -> None:
    """The real count, /proc/stat's: a spinning child is in every sample."""
    child = subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"])
    try:
        assert _within(5.0, lambda: running_besides_caller() >= 1)
    finally:
        child.kill()
        child.wait()
    assert running_besides_caller(samples=1) >= 0


def test_no_board_no_seat(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert step_threads_from_env("prefill", 1, {}) is None
    with caplog.at_level(logging.WARNING):
        missing = {CORE_BOARD.name: str(tmp_path / "gone")}
        assert step_threads_from_env("prefill", 1, missing) is None
    assert "is gone: 1 thread(s) per step" in caplog.text


def test_serve_board_names_the_file_for_the_workers_and_removes_it() -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    with serve_board(ServeCores(board=True, short_spin=True), environ) as path:
        assert path is not None and path.stat().st_size == BOARD_BYTES
        assert environ[CORE_BOARD.name] == str(path)
        assert environ["GOMP_SPINCOUNT"] == "1000"  # team threads spin briefly, then sleep
        assert CoreBoard(path).claim(os.getpid()) == 0
    assert not path.exists() and environ == {"PATH": "/bin"}
    with serve_board(ServeCores(board=False, short_spin=True), environ) as none:
        assert none is None and environ == {"PATH": "/bin", "GOMP_SPINCOUNT": "1000"}
    with serve_board(ServeCores(board=False, short_spin=False), environ) as none:
        assert none is None and environ == {"PATH": "/bin"}


@pytest.mark.parametrize("theirs", [{"GOMP_SPINCOUNT": "10000"}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_serve_board_keeps_an_openmp_wait_set_by_the_user(theirs: dict[str, str]) -> None:
    environ = dict(theirs)
    with serve_board(ServeCores(board=True, short_spin=True), environ):
        assert environ.keys() == {*theirs, CORE_BOARD.name} and theirs.items() <= environ.items()
    assert environ == theirs


def test_a_worker_process_started_under_the_board_spins_briefly_at_barriers() -> None:
    """What the workers inherit takes effect: libgomp in a process started inside the block
    spins 1,000 times before it sleeps (OMP_DISPLAY_ENV: it prints its settings as it loads),
    where one started outside spins its default 300,000."""
    skip = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    environ = {k: v for k, v in os.environ.items() if k not in skip}
    environ["OMP_DISPLAY_ENV"] = "VERBOSE"

    def spin_count() -> str:
        out = subprocess.run(
            [sys.executable, "-c", "import torch"], env=environ, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        if "GOMP_SPINCOUNT" not in out.stderr:
            pytest.skip("torch here does not load libgomp")
        return out.stderr.split("GOMP_SPINCOUNT = ")[1].split()[0]

    with serve_board(ServeCores(board=False, short_spin=True), environ):
        assert spin_count() == "'1000'"
    assert spin_count() == "'300000'"


# -- in the engine loop --


class RecordingSeat(StepThreads):
    """A real seat that also records each step's team size and the loop thread's count."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.teams: list[tuple[int, int]] = []

    def before_step(self) -> int:
        team = super().before_step()
        self.teams.append((team, torch.get_num_threads()))
        return team


def test_the_engine_loop_borrows_while_the_partner_idles(
    board_path: Path, make_engine: EngineFactory
) -> None:
    board = CoreBoard(board_path)
    partner = CoreBoard(board_path)
    partner_slot = partner.claim(os.getppid())
    slot = board.claim(os.getpid())
    assert slot is not None and partner_slot is not None
    seat = RecordingSeat(board, slot, share=1, cores=2, borrows=True, running_elsewhere=lambda: 0)
    loop = EngineLoop(make_engine(), step_threads=seat)
    params = SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3)

    async def run(rid: str) -> None:
        async for _ in request_deltas(loop, EngineRequest(rid, list(range(3, 20)), params)):
            pass

    try:
        asyncio.run(run("alone"))
        assert seat.teams == [(2, 2)] * 3  # a prompt step and two more: both cores
        # Idle again right after its last step (which delivered the last token just before).
        assert _within(2.0, lambda: partner.others(partner_slot) == 0)
        seat.teams.clear()
        partner.publish(partner_slot, 1)  # the decode worker runs now
        asyncio.run(run("beside"))
        assert seat.teams == [(1, 1)] * 3
    finally:
        loop.shutdown()
    assert board.others(partner_slot) == 0  # the seat was given back at shutdown


def _within(seconds: float, condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    out = subprocess.run(
        [sys.executable, "-S", "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


# -- in `kvrelay serve` --


@pytest.mark.slow
@pytest.mark.e2e
def test_kvrelay_serve_seats_its_two_workers_on_one_board(tmp_path: Path) -> None:
    """The real `kvrelay serve` (P/D) forced to share (KVRELAY_CORE_SHARE=on, whatever the
    cores here): both Ray workers claim a slot on the board it made, a prompt longer than
    the local-prefill limit is served, both are idle after it, and the board is removed."""
    from tests.servers import start_server

    server = start_server(tmp_path, env={CORE_SHARE.name: "on"})
    try:
        assert "kvrelay: cores shared step by step" in server.log()
        board, pids = _board_of(server.process.pid)
        assert len(pids) == 2  # the prefill worker and the decode worker
        body = {"model": server.model, "prompt": list(range(100, 228)), "max_tokens": 4}
        request = urllib.request.Request(
            f"{server.http_url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 4
        assert _within(5.0, lambda: CoreBoard(board).others(-1) == 0)
    finally:
        server.stop()
    assert not board.exists()


def _board_of(server_pid: int) -> tuple[Path, list[int]]:
    """The board whose claimed slots belong to processes under `server_pid` (other boards
    may be on this machine: other servers), and those pids."""
    for path in Path("/dev/shm").glob("kvrelay-cores-*"):
        mapped = path.read_bytes()
        pids = [pid for pid, _ in struct.iter_unpack("<iI", mapped) if pid]
        if pids and all(_descends(pid, server_pid) for pid in pids):
            return path, pids
    raise AssertionError(f"no core board with workers of server {server_pid}")


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False
