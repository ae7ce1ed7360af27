"""Device kernels per decoder layer of an eager decode step, on fake CUDA: the launches the
fused kernels must bring down (tests/fake_cuda/launches.py says what counts as one).

The counts are taken in a process of their own, as test_fake_cuda.py's scenarios are (the fake
runtime is process-wide): this module run as `python -m tests.engine.test_kernels_per_layer
OUT.json` writes them, the tests below read them. Two small bf16 Llamas (2 and 4 layers) take
one eager pure-decode step of 4 rows; each layer's forward is counted, and the whole steps too,
so that the per-layer figure is checked by differencing (4-layer step - 2-layer step) / 2.

What this does not do: time anything (benchmarks/host_overhead.py), or count graphed steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
KERNELS_PER_LAYER_CAP = 10  # the fused layer: norms, QKV, RoPE + KV write, attention, MLP
LAYER_COUNTS = (2, 4)
ROWS = 4  # decoding requests in the counted step

pytestmark = pytest.mark.skipif(
    torch.backends.cuda.is_built(), reason="fake CUDA needs a CPU-only torch (GPU tests cover it)"
)


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("kernels-per-layer") / "counts.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.test_kernels_per_layer", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


def test_the_counter_counts_launches_and_nothing_else(counts: dict[str, Any]) -> None:
    """The measuring stick itself, on a hand-written sequence of device ops (`count_probe`):
    if it read 0, or counted views, the cap below would pass for nothing."""
    assert counts["probe"] == {
        # x + 1, mul_, a cast, a transposed copy, and one stand-in kernel (its own checks'
        # select and is_contiguous are the rig's, not counted)
        "kernels": {"add": 1, "mul_": 1, "to": 1, "contiguous": 1, "stand_in:copy_blocks": 1},
        "uploads": 1,
        "downloads": 0,
        # view, t (twice), split, empty_like, and a `to` with nothing to do
        "no_launch": 6,
    }


def test_per_layer_counts_agree_with_the_difference_of_whole_steps(
    counts: dict[str, Any],
) -> None:
    two, four = (counts["models"][str(n)] for n in LAYER_COUNTS)
    assert two["per_layer"] == four["per_layer"] > 0
    assert (four["step_kernels"] - two["step_kernels"]) / 2 == four["per_layer"]
    # Every layer attends through the decode kernel: it was a pure decode step.
    for layers, model in zip(LAYER_COUNTS, (two, four), strict=True):
        assert model["layer_kernels"]["stand_in:decode"] == layers


@pytest.mark.parametrize("layers", LAYER_COUNTS)
def test_an_eager_decode_layer_launches_at_most_the_cap(
    counts: dict[str, Any], layers: int
) -> None:
    """With the fused layer ops (fceddbd) a layer launches 9 kernels, where it launched 28-32
    before (two norms of four ops each, RoPE's six, a transposed copy after each matmul)."""
    model = counts["models"][str(layers)]
    assert model["per_layer"] <= KERNELS_PER_LAYER_CAP, model["layer_kernels"]


# --- the child process ------------------------------------------------------------------


def count_probe(counter: Any) -> dict[str, Any]:
    """A known sequence of device ops, counted."""
    from tests.fake_cuda.kernels import FakeCudaKernels

    x = torch.empty(4, 8, dtype=torch.bfloat16, device="cuda")
    kv_cache = torch.empty(4, 1, 2, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    src = torch.zeros(1, dtype=torch.int64).to("cuda", non_blocking=True)
    host = torch.ones(4, 8, dtype=torch.bfloat16)
    # Inference mode, as the runner's steps: composite ops (`to`, `contiguous`) reach the
    # dispatch mode whole there, and are told apart by what they return.
    with torch.inference_mode(), counter.counting() as counted:
        x.view(32)
        x.t()
        x.split(4, dim=1)
        torch.empty_like(x)
        x.to(torch.bfloat16)  # already bf16: returns x
        (x + 1).mul_(2)
        x.float()
        x.t().contiguous()
        host.to("cuda", non_blocking=True)
        FakeCudaKernels.copy_blocks(kv_cache, src, src)
    return {
        "kernels": dict(counted.kernels),
        "uploads": counted.uploads,
        "downloads": counted.downloads,
        "no_launch": counted.no_launch,
    }


def count_model(model: Path, counter: Any, mode: Any) -> dict[str, Any]:
    """One eager pure-decode step of ROWS requests: kernels in the layers and in all."""
    from kvrelay.common.sampling_params import SamplingParams
    from tests.fake_cuda.launches import counting_layers
    from tests.fake_cuda.scenarios import fake_sampling, make_engine

    engine = make_engine(model, enforce_eager=True)
    fake_sampling(engine)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    for i in range(ROWS):
        engine.add_request(f"r{i}", [3 + i] * 10, params)
    layers = engine.runner.model.layers  # type: ignore[attr-defined]
    with mode.strict_rules():
        engine.step()  # the prefill
        engine.step()  # the first decode
        with counter.counting() as step, counting_layers(counter, layers) as inside:
            engine.step()
    return {
        "per_layer": inside.num_kernels / len(layers),
        "layer_kernels": dict(inside.kernels),
        "step_kernels": step.num_kernels,
    }


def main(out: Path) -> None:
    from tests.fake_cuda import kernels, launches, runtime
    from tests.fake_cuda.mode import FakeCudaMode
    from tests.fake_cuda.scenarios import patch_loading, write_model

    monkeypatch = pytest.MonkeyPatch()
    mode = FakeCudaMode()
    runtime.install(monkeypatch, mode)
    launches.wrap_stand_ins(monkeypatch, mode)  # before install: it hands the wrapped ones on
    kernels.install(monkeypatch)
    patch_loading(monkeypatch)
    counter = launches.LaunchCounter(mode)
    with tempfile.TemporaryDirectory() as folder:
        paths = {n: write_model(Path(folder) / f"llama-{n}", 64, num_hidden_layers=n)
                 for n in LAYER_COUNTS}  # fmt: skip
        with mode:
            models = {str(n): count_model(path, counter, mode) for n, path in paths.items()}
            result = {"probe": count_probe(counter), "models": models}
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
