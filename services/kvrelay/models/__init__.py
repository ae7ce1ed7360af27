"""Llama-family models over the paged KV cache: the decoder, weight loading and the default model.

Importing this package stays cheap: transformers and gguf are imported only where needed.
"""

from __future__ import annotations

from kvrelay.models.default_model import (
    DEFAULT_MODEL_NAME,
    DefaultModelError,
    default_model_dir,
    is_default_model_ready,
    pull_default_model,
)
from kvrelay.models.inputs import AttentionInputs
from kvrelay.models.llama import CausalLM
from kvrelay.models.loader import MissingWeightError, load_model
from kvrelay.models.tokenizer import load_tokenizer

__all__ = [
    "DEFAULT_MODEL_NAME",
    "AttentionInputs",
    "CausalLM",
    "DefaultModelError",
    "MissingWeightError",
    "default_model_dir",
    "is_default_model_ready",
    "load_model",
    "load_tokenizer",
    "pull_default_model",
]
