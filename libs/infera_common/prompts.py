"""How many prompts an OpenAI completions ``prompt`` holds (pure).

A text, or a list of token ids, is one prompt; a list of texts, or of token-id lists, is a batch of
them (the engines answer each with its own choices). Chat requests hold one prompt.
"""

from __future__ import annotations

from typing import Any


def prompt_count(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1
