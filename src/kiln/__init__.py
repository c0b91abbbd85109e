"""Kiln: an LLM API gateway in front of self-hosted model servers."""

__version__ = "0.1.0"
