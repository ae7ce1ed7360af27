"""kvrelay: LLM serving with disaggregated prefill and decode.

`from kvrelay import LLM, SamplingParams, StructuredOutputs` is the offline API; the rest
lives in subpackages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
    "__version__",
]

if TYPE_CHECKING:
    from kvrelay.common.sampling_params import SamplingParams
    from kvrelay.common.structured_outputs import StructuredOutputs
    from kvrelay.engine.outputs import CompletionOutput, RequestOutput
    from kvrelay.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy, so `kvrelay --help` and light imports do not pay for torch.
    if name == "LLM":
        from kvrelay.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvrelay.common.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":
        from kvrelay.common.structured_outputs import StructuredOutputs

        return StructuredOutputs
    if name in ("RequestOutput", "CompletionOutput"):
        from kvrelay.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")
