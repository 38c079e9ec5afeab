"""Patches of mitmproxy internals the security argument rests on: bounds, admission, dials."""
