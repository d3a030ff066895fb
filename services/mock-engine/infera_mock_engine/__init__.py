"""Infera mock engine: a simulated LLM inference engine speaking the SGLang and vLLM HTTP APIs.

It imports nothing from Infera (it stands in for a real engine). See ../README.md.
"""

__version__ = "0.1.0"
