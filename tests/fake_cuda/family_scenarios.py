"""The new families' device paths on fake CUDA, in a process of their own:
`python -m tests.fake_cuda.family_scenarios OUT.json` (tests/engine/test_fake_cuda_families.py).

Qwen3 on the `cuda` backend (decode kernel, Triton split of mixed steps, CUDA graphs) with its
q/k norms, which must keep the fused rope+KV-write launch away (it rotates raw q/k); Gemma 2
(alternating windows, soft caps) and Gemma 3 (windows, local RoPE, q/k norms) on the auto
backend (`cuda`: run where it claims the variants, refused at load where it does not), and
Gemma 3 on the device through the `torch` backend. The rig and helpers are
tests/fake_cuda/scenarios.py's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrelay_kernels import select_backend
from tests.fake_cuda.mode import FakeCudaMode
from tests.fake_cuda.scenarios import (
    add_mixed_requests,
    fake_sampling,
    install_rig,
    make_engine,
    run_one,
    run_steps,
)
from tests.hf_checkpoints import make_checkpoint

# Shapes the cuda backend's decode kernel takes (head_dim 64), a vocabulary for the scenario's
# token ids (up to 202), and room for max_model_len 1024.
SHAPE = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}
GEMMA2 = {
    **SHAPE,
    "sliding_window": 8,
    "query_pre_attn_scalar": 64,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
GEMMA3 = {
    **SHAPE,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 64,
    "final_logit_softcapping": 30.0,
}


def scenario_run(model: Path, mode: FakeCudaMode, **overrides: Any) -> dict[str, Any]:
    """scenarios.scenario_engine's run, plus what the model is made of."""
    engine = make_engine(model, **overrides)
    fake_sampling(engine)
    add_mixed_requests(engine)
    result = run_steps(engine, mode)
    result["backend"] = engine.runner.model.backend.name
    result["graphs"] = engine.runner.graphs is not None
    return result


def scenario_auto(model: Path, mode: FakeCudaMode) -> dict[str, Any]:
    """The auto backend on CUDA (`cuda`): the run where it claims sliding windows, else the
    refusal at load."""
    claims = select_backend("cuda").sliding_window
    try:
        return {"claims_window": claims, **scenario_run(model, mode)}
    except ValueError as error:
        return {"claims_window": claims, "refused": str(error)}


def main(out: Path) -> None:
    mode = install_rig()
    folder = out.parent
    qwen3, gemma2, gemma3 = folder / "qwen3", folder / "gemma2", folder / "gemma3"
    make_checkpoint(qwen3, "qwen3", SHAPE)
    make_checkpoint(gemma2, "gemma2", GEMMA2)
    make_checkpoint(gemma3, "gemma3", GEMMA3)
    scenarios: dict[str, Callable[[], Any]] = {
        "qwen3_graphs": lambda: scenario_run(qwen3, mode),
        "qwen3_eager": lambda: scenario_run(qwen3, mode, enforce_eager=True),
        "gemma2_auto": lambda: scenario_auto(gemma2, mode),
        "gemma3_auto": lambda: scenario_auto(gemma3, mode),
        "gemma3_torch": lambda: scenario_run(gemma3, mode, attention_backend="torch"),
    }
    results: dict[str, Any] = {}
    with mode:
        for name, run in scenarios.items():
            results[name] = run_one(mode, run)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
