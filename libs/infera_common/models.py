"""The model bundled with Infera: the SmolLM2-135M-Instruct tokenizer (no weights)."""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """Directory of the bundled tokenizer (tokenizer.json + tokenizer_config.json with chat template)."""
    return Path(__file__).resolve().parent / "models" / BUNDLED_MODEL_NAME
