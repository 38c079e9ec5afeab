"""Sandgate: the egress proxy between AI-agent sandboxes and the internet."""

__version__ = "0.1.0"
