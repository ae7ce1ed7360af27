"""Session-wide fixtures: the real default model, pulled and converted once, and one local Ray
cluster shared by every test that needs one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.servers import ServerProcess, start_server

# `--dtype auto` is bfloat16 on CPUs with native bf16 and float32 on the others: the suite's
# token-exact checks (against transformers in fp32, across batch shapes) would then depend on
# the machine. Every engine the tests start (in this process, Ray actors, servers) inherits
# this; tests of bf16 ask for it by name.
os.environ.setdefault("KVRELAY_CPU_AUTO_DTYPE", "float32")
# Likewise a single-row fp32 matmul's path: measured at load (models/single_row.py), so a
# loaded machine could pick differently in two processes; pinned to the dense one.
os.environ.setdefault("KVRELAY_CPU_SINGLE_ROW", "dense")
# And a many-row bf16 matmul's path (models/many_rows.py): pinned to kvrelay's blocked kernel;
# tests/models/test_many_rows.py runs the bf16 checks on each path by name.
os.environ.setdefault("KVRELAY_CPU_MANY_ROWS", "blocked")
# And on a GPU, a decode step's attention kernel (kvrelay_kernels/decode_dispatch.py): timed at
# load, so pinned to the CUDA kernel; the dispatch's tests ask for `auto` or Triton by name.
# (Not on the fake-CUDA rig: nothing is timed there, and a pin would refuse its head_dim 32.)
if torch.cuda.is_available():
    os.environ.setdefault("KVRELAY_DECODE_ATTENTION", "cuda")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (`make test` pulls it before pytest runs)."""
    from kvrelay.models.default_model import pull_default_model

    return pull_default_model(progress=False)


REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A local Ray cluster for the whole session (or the one already up). Started once: a
    second `ray.init` in one process fails, so every Ray fixture builds on this one."""
    ray = pytest.importorskip("ray")
    # Actor processes import test modules (tests.transfer.peers, tests.router.fake_worker):
    # they inherit this environment.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), old) if p)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
    yield
    if started:
        ray.shutdown()
    if old is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = old


# The shared server's bounds are small so that the overload test can fill them; prompts of
# more than 16 uncached tokens go through the prefill worker, shorter ones run whole on the
# decode worker, so the tests cross both paths.
SERVER_ARGS = (
    "--max-in-flight", "4",
    "--max-queued", "2",
    "--max-local-prefill-tokens", "16",
    "--kv-cache-memory", "256MiB",
)  # fmt: skip


@pytest.fixture(scope="session")
def kvrelay_server(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A real `kvrelay serve` (Ray, 1 prefill + 1 decode worker, router, both APIs) on free
    loopback ports, shared by the session: `.http_url`, `.grpc_target`, `.model`."""
    server = start_server(tmp_path_factory.mktemp("server"), *SERVER_ARGS)
    yield server
    server.stop()
