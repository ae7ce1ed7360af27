"""Device kernels of one sampler call on fake CUDA: the Triton sampler (one launch for every
non-greedy row) must keep a 256-row batch to a handful of kernels, where the torch ops took
~12 (temperature only) to ~40 (top-k / top-p / min-p) per step.

Counted in a process of their own, as test_kernels_per_layer.py's (the fake runtime is
process-wide): this module run as `python -m tests.engine.test_sampler_kernels OUT.json`
writes the counts, the test reads them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ROWS = 256
VOCAB = 49152
KERNELS_CAP = 6  # copy of the logits, gather of the rows, the sampler, scatter of the ids

pytestmark = pytest.mark.skipif(
    torch.backends.cuda.is_built(), reason="fake CUDA needs a CPU-only torch (GPU tests cover it)"
)


def test_a_sampled_batch_is_a_handful_of_kernels(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.test_sampler_kernels", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    counts = json.loads(out.read_text())
    assert counts["greedy"]["kernels"] == 1  # argmax alone
    for kind in ("random", "topkp"):
        assert counts[kind]["kernels"] <= KERNELS_CAP, counts[kind]
        assert counts[kind]["sample_rows"] == 1, counts[kind]
        assert counts[kind]["uploads"] <= 2, counts[kind]  # the row index, the parameters


def _params(kind: str) -> object:
    from kvrelay.common.sampling_params import SamplingParams

    if kind == "greedy":
        return SamplingParams(temperature=0.0)
    if kind == "random":
        return SamplingParams(temperature=0.8)
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05)


def main(out: Path) -> None:
    from kvrelay.engine.sampler import Sampler, SamplingRow
    from tests.fake_cuda import kernels, launches, runtime
    from tests.fake_cuda.mode import FakeCudaMode

    monkeypatch = pytest.MonkeyPatch()
    mode = FakeCudaMode()
    runtime.install(monkeypatch, mode)
    launches.wrap_stand_ins(monkeypatch, mode)  # before install: it hands the wrapped ones on
    kernels.install(monkeypatch)
    counter = launches.LaunchCounter(mode)
    sampler = Sampler(torch.Generator().manual_seed(0))
    counts = {}
    with mode:
        logits = torch.empty(ROWS, VOCAB, device="cuda")
        for kind in ("greedy", "random", "topkp"):
            rows = [SamplingRow(_params(kind), [1, 2], [3], None, (2,)) for _ in range(ROWS)]  # type: ignore[arg-type]
            u = sampler.draw_uniforms(rows)
            with mode.strict_rules(), counter.counting() as seen:
                sampler.sample_on_device(logits, rows, u)
            counts[kind] = {
                "kernels": seen.num_kernels,
                "uploads": seen.uploads,
                "sample_rows": seen.kernels.get("stand_in:sample_rows", 0),
            }
    out.write_text(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
