"""mitmproxy's header lookups, the same answers without the detours (profiled: ~4% of the CPU).

`Headers.get`, `in` and `get_all` are asked a dozen times per request (mitmproxy's HTTP/1
framing: content-length, transfer-encoding, connection, expect; Sandgate's stages). In
mitmproxy 11.0.2 each goes `Mapping.get` -> `__getitem__` -> `Headers.get_all` (converting the
name) -> `MultiDict.get_all` (a call to `_kconv` per field) -> `_reduce_values`, and a missing
header (the common case) raises and catches a KeyError on the way. The replacements compare
the same way (the name as bytes, `bytes.lower()` on both sides; the fields' lowered names are
remembered until the fields change, so a missing header is one tuple membership test), decode
values the same way (UTF-8, surrogateescape) and fold them with the same `_reduce_values`; a name
that is neither str nor bytes fails as it did. `unit/test_headerlookup.py` checks them against
the originals (hypothesis).
"""

from __future__ import annotations

from typing import Any

from mitmproxy import http

_MARK = "_sandgate_headerlookup"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


_MEMO = "_sandgate_names"  # Headers.__dict__: (fields, their names in lower case)

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


def _names(self: http.Headers) -> tuple[bytes, ...]:
    """The field names in lower case, remembered for this `fields` tuple (every change to the
    headers replaces the tuple; the memo holds it, so its id cannot be reused meanwhile)."""
    fields = self.fields
    memo = self.__dict__.get(_MEMO)
    if memo is not None and memo[0] is fields:
        return memo[1]  # type: ignore[no-any-return]
    names = tuple(f.lower() for f, _ in fields)
    self.__dict__[_MEMO] = (fields, names)
    return names


def _values(self: http.Headers, k: bytes) -> list[str]:
    names = _names(self)
    if k not in names:
        return []
    fields = self.fields
    return [fields[i][1].decode("utf-8", "surrogateescape")
            for i, n in enumerate(names) if n == k]


def get_all(self: http.Headers, name: str | bytes) -> list[str]:
    return _values(self, _key(name))


def get(self: http.Headers, key: str | bytes, default: Any = None) -> Any:
    values = _values(self, _key(key))
    if not values:
        return default
    return self._reduce_values(values)


def contains(self: http.Headers, key: object) -> bool:
    return _key(key) in _names(self)


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
