"""Keep secret values from leaking back to a sandbox: replace them in what flows to it.

Every occurrence of a secret value becomes ``[REDACTED:<name>]``. Matching is leftmost, and at
a position the longest secret wins (one secret may be a prefix of another). The streaming
scrubber gives exactly the same output as scrubbing the whole body at once, however the body
is chunked, while holding back fewer bytes than the longest secret.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import AnyStr

REDACTED_TEMPLATE = "[REDACTED:{name}]"


def _order(values: list[AnyStr]) -> list[AnyStr]:
    # Python's regex alternation takes the first alternative that matches: longest first
    # yields the longest match at each position.
    return sorted(values, key=len, reverse=True)


def _compile_bytes(
    secrets: Mapping[str, bytes],
) -> tuple[re.Pattern[bytes] | None, dict[bytes, bytes], int]:
    """(pattern of all values, value -> replacement, longest length); empty values skipped.

    When two names share a value, the first name wins.
    """
    replacement: dict[bytes, bytes] = {}
    for name, value in secrets.items():
        value = bytes(value)
        if value and value not in replacement:
            replacement[value] = REDACTED_TEMPLATE.format(name=name).encode("utf-8")
    if not replacement:
        return None, replacement, 0
    values = _order(list(replacement))
    return re.compile(b"|".join(re.escape(v) for v in values)), replacement, len(values[0])


def _compile_text(
    secrets: Mapping[str, str],
) -> tuple[re.Pattern[str] | None, dict[str, str], int]:
    replacement: dict[str, str] = {}
    for name, value in secrets.items():
        if value and value not in replacement:
            replacement[value] = REDACTED_TEMPLATE.format(name=name)
    if not replacement:
        return None, replacement, 0
    values = _order(list(replacement))
    return re.compile("|".join(re.escape(v) for v in values)), replacement, len(values[0])


class StreamScrubber:
    """Scrub a byte stream chunk by chunk. `feed` what arrives, `flush` at the end.

    `feed` returns what is safe to emit now and holds back at most ``max_len - 1`` trailing
    bytes: only those could still begin a secret that the next chunk completes (or a longer
    secret than the one they already contain).
    """

    def __init__(self, secrets: Mapping[str, bytes]) -> None:
        self._pattern, self._replacement, self.max_len = _compile_bytes(secrets)
        self._held = b""
        self.replacements = 0

    @property
    def held(self) -> int:
        """How many bytes are held back right now (always < max_len)."""
        return len(self._held)

    def feed(self, chunk: bytes) -> bytes:
        if self._pattern is None:
            return bytes(chunk)
        buf = self._held + chunk if self._held else bytes(chunk)
        # A match starting before `cutoff` is final: every secret that could start there fits
        # entirely inside `buf`. Positions from `cutoff` on must wait for more data.
        cutoff = len(buf) - (self.max_len - 1)
        if cutoff <= 0:
            self._held = buf
            return b""
        out: list[bytes] = []
        pos = 0
        for m in self._pattern.finditer(buf):
            start = m.start()
            if start >= cutoff:
                break
            out.append(buf[pos:start])
            out.append(self._replacement[m.group()])
            self.replacements += 1
            pos = m.end()
        keep_from = max(pos, cutoff)
        out.append(buf[pos:keep_from])
        self._held = buf[keep_from:]
        return b"".join(out)

    def flush(self) -> bytes:
        """Everything still held back, scrubbed. The scrubber may be reused afterwards."""
        held, self._held = self._held, b""
        if self._pattern is None or not held:
            return held
        out, n = self._pattern.subn(lambda m: self._replacement[m.group()], held)
        self.replacements += n
        return out


def scrub_bytes(data: bytes, secrets: Mapping[str, bytes]) -> tuple[bytes, int]:
    """`data` with every secret value replaced, and how many replacements were made."""
    pattern, replacement, _ = _compile_bytes(secrets)
    if pattern is None:
        return bytes(data), 0
    return pattern.subn(lambda m: replacement[m.group()], data)


def scrub_text(text: str, secrets: Mapping[str, str]) -> tuple[str, int]:
    """`text` (a header value, say) with every secret value replaced, and the count."""
    pattern, replacement, _ = _compile_text(secrets)
    if pattern is None:
        return text, 0
    return pattern.subn(lambda m: replacement[m.group()], text)


def find_secrets(data: bytes | str, needles: Mapping[str, str]) -> list[str]:
    """Names of the needles (placeholders or secret values) that occur in `data`, in order.

    Bytes are searched for each needle's UTF-8 encoding. Empty needles never match.
    """
    found: list[str] = []
    if isinstance(data, str):
        for name, needle in needles.items():
            if needle and needle in data and name not in found:
                found.append(name)
    else:
        for name, needle in needles.items():
            if needle and needle.encode("utf-8") in data and name not in found:
                found.append(name)
    return found
