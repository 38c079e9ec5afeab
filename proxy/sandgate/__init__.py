"""Sandgate: the egress proxy between AI-agent sandboxes and the internet."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sandgate")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
