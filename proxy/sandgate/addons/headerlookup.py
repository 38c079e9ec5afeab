"""mitmproxy's header lookups, the same answers without the detours (profiled: ~4% of the CPU).

`Headers.get`, `in` and `get_all` are asked a dozen times per request (mitmproxy's HTTP/1
framing: content-length, transfer-encoding, connection, expect; Sandgate's stages). In
mitmproxy 11.0.2 each goes `Mapping.get` -> `__getitem__` -> `Headers.get_all` (converting the
name) -> `MultiDict.get_all` (a call to `_kconv` per field) -> `_reduce_values`, and a missing
header (the common case) raises and catches a KeyError on the way. The replacements walk the
fields once with the same comparison (the name as bytes, `bytes.lower()` on both sides), decode
values the same way (UTF-8, surrogateescape) and fold them with the same `_reduce_values`; a name
that is neither str nor bytes fails as it did. `unit/test_headerlookup.py` checks them against
the originals (hypothesis).
"""

from __future__ import annotations

from typing import Any

from mitmproxy import http

_MARK = "_sandgate_headerlookup"

ORIGINAL_GET_ALL = http.Headers.get_all
ORIGINAL_GET = http.Headers.get
ORIGINAL_CONTAINS = http.Headers.__contains__


_KEYS: dict[str, bytes] = {}  # the names code asks for (constants): their bytes, lower case


def _key(name: Any) -> bytes:
    # mitmproxy: _always_bytes(name) then _kconv (lower); None and other types fail as there
    if type(name) is str:
        k = _KEYS.get(name)
        if k is None:
            k = name.encode("utf-8", "surrogateescape").lower()
            if len(_KEYS) < 1024:
                _KEYS[name] = k
        return k
    raw = name if type(name) is bytes else http._always_bytes(name)
    return raw.lower()


def get_all(self: http.Headers, name: str | bytes) -> list[str]:
    k = _key(name)
    return [v.decode("utf-8", "surrogateescape") for f, v in self.fields if f.lower() == k]


def get(self: http.Headers, key: str | bytes, default: Any = None) -> Any:
    k = _key(key)
    values = [v.decode("utf-8", "surrogateescape") for f, v in self.fields if f.lower() == k]
    if not values:
        return default
    return self._reduce_values(values)


def contains(self: http.Headers, key: object) -> bool:
    k = _key(key)
    for f, _ in self.fields:
        if f.lower() == k:
            return True
    return False


def install() -> None:
    cls = http.Headers
    if getattr(cls, _MARK, False):
        return
    cls.get_all = get_all  # type: ignore[method-assign]
    cls.get = get  # type: ignore[method-assign, assignment]
    cls.__contains__ = contains  # type: ignore[method-assign, assignment]
    setattr(cls, _MARK, True)


def installed() -> bool:
    return bool(getattr(http.Headers, _MARK, False))
