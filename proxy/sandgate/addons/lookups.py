"""Reflection mitmproxy repeats on every hook and option read, done once (profiled with
cProfile under `bench/focus.py --phase new_conn`: about 35 hook argument lists and 19 option
reads per passthrough tunnel).

1. `Hook.args()` lists a hook's dataclass fields with `dataclasses.fields(self)` on every call
   (each hook is asked for its arguments three to five times on its way through the addon
   manager). The field names of a hook class never change: they are listed once per class and
   the values read as before, in the same order.
2. Every `options.NAME` read deep-copies the option's value (`_Option.current`). For a str,
   int, bool, float, bytes or None value `copy.deepcopy` returns the object itself, so the
   copy is skipped for exactly those types; any other value (lists, tuples of lists...) is
   still copied by mitmproxy's own code.

Neither changes a value any caller sees.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mitmproxy import hooks, optmanager

_MARK = "_sandgate_lookups"
_NAMES: dict[type, tuple[str, ...]] = {}
# copy.deepcopy returns values of these types unchanged (copy._deepcopy_atomic)
_ATOMIC = frozenset({str, int, bool, float, bytes, type(None)})

ORIGINAL_ARGS = hooks.Hook.args
ORIGINAL_CURRENT = optmanager._Option.current


def args(self: hooks.Hook) -> list[Any]:
    names = _NAMES.get(type(self))
    if names is None:
        names = _NAMES[type(self)] = tuple(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]
    return [getattr(self, name) for name in names]


def current(self: Any) -> Any:
    v = self._default if self.value is optmanager.unset else self.value
    if type(v) in _ATOMIC:
        return v
    return ORIGINAL_CURRENT(self)


def install() -> None:
    if getattr(hooks.Hook, _MARK, False):
        return
    hooks.Hook.args = args  # type: ignore[method-assign]
    optmanager._Option.current = current  # type: ignore[method-assign]
    setattr(hooks.Hook, _MARK, True)


def installed() -> bool:
    return bool(getattr(hooks.Hook, _MARK, False))
