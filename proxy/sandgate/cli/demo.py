"""`sandgate demo`: Sandgate at work offline (OpenBao, a stand-in LLM API, the proxy)."""

from __future__ import annotations

from sandgate.demo import register

__all__ = ["register"]
