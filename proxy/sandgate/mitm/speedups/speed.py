"""mitmproxy work Sandgate does not need, turned off (profiled under keep-alive load).

1. Inert addons leave per-flow dispatch. mitmproxy's default addons include a dozen features
   whose option Sandgate pins to "off" (addons/pinned.py: map_local, modify_headers, ...): each
   still gets every request/response hook only to return at once (about 3% of the CPU). Those
   addons stay loaded (their options exist, so `--set` of them is refused as pinned, and the
   Pinned addon still refuses changes), but `CachedAddons` no longer calls their per-flow hooks.
   An addon is only skipped while its option is pinned to the inert value named here.
2. The debug-only type checks of every parsed request and response. mitmproxy's `MessageData`
   checks each field's type in `__post_init__` under `if __debug__:`, i.e. only when Python
   runs without -O (about 5% of the CPU). Sandgate cannot run with -O (its asserts must stay),
   so the checks are removed directly: they check what mitmproxy's own parser built, not input.
3. A throwaway server connection per request. `Context.fork` (every HTTP stream, i.e. every
   request) builds a `Context`, whose constructor makes a new `Server` (a uuid4, a dataclass,
   checked attribute writes), and then replaces it by the parent's. The fork now copies the
   four attributes straight away: the same context, without the object nobody sees.
4. `Hook.args` walks `dataclasses.fields()` on every call (three times per hook). The field
   names of a hook class are fixed: they are looked up once per class.
5. Every read of an option (`ctx.options.x`, `context.options.x`: several per request) returns
   `copy.deepcopy` of its value. For a str, bytes, number, bool or None deepcopy returns the
   object itself; such values are now returned without the call. Others are still copied.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from mitmproxy import hooks, http, master, optmanager
from mitmproxy.proxy import context

_MARK = "_sandgate_speed"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


# addon name -> (the pinned option that makes it inert, that value)
INERT: dict[str, tuple[str, Any]] = {
    "maplocal": ("map_local", []),
    "mapremote": ("map_remote", []),
    "modifyheaders": ("modify_headers", []),
    "modifybody": ("modify_body", []),
    "anticache": ("anticache", False),
    "anticomp": ("anticomp", False),
    "stickyauth": ("stickyauth", None),
    "stickycookie": ("stickycookie", None),
    "savehar": ("hardump", ""),
    "save": ("save_stream_file", None),
    "blocklist": ("block_list", []),
    "serverplayback": ("server_replay", []),
    # no validator, no upstream credentials, no mitm.it app: their hooks return at once
    "proxyauth": ("proxyauth", None),
    "upstreamauth": ("upstream_auth", None),
    "onboarding": ("onboarding", False),
}


def inert_addons(m: master.Master, pinned_values: Mapping[str, Any]) -> set[Any]:
    """The loaded addons whose per-flow hooks are no-ops under the pinned options."""
    out: set[Any] = set()
    for name, (option, value) in INERT.items():
        addon = m.addons.get(name)
        if addon is None:
            continue
        if option in pinned_values and pinned_values[option] == value \
                and getattr(m.options, option) == value:
            out.add(addon)
    return out


def _no_type_checks(self: Any) -> None:
    return None


def _fork(self: context.Context) -> context.Context:
    """mitmproxy 12.3.1's Context.fork, without building the Server it then discards."""
    ret = context.Context.__new__(context.Context)
    ret.client = self.client
    ret.options = self.options
    ret.server = self.server
    ret.layers = self.layers.copy()
    return ret


_HOOK_FIELDS: dict[type, tuple[str, ...]] = {}
_ATOMS = frozenset({str, bytes, int, float, bool, type(None)})  # deepcopy(x) is x


def _option_current(self: optmanager._Option) -> Any:
    """mitmproxy's _Option.current: a deep copy of the value (the value itself for atoms)."""
    v = self._default if self.value is optmanager.unset else self.value
    return v if type(v) in _ATOMS else copy.deepcopy(v)


def _hook_args(self: hooks.Hook) -> list[Any]:
    """mitmproxy's Hook.args: the dataclass fields' values, in order."""
    names = _HOOK_FIELDS.get(type(self))
    if names is None:
        names = _HOOK_FIELDS[type(self)] = tuple(
            f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]
    return [getattr(self, n) for n in names]


def install() -> None:
    if getattr(http.MessageData, _MARK, False):
        return
    http.MessageData.__post_init__ = _no_type_checks  # type: ignore[method-assign]
    context.Context.fork = _fork  # type: ignore[method-assign]
    hooks.Hook.args = _hook_args  # type: ignore[method-assign]
    optmanager._Option.current = _option_current  # type: ignore[method-assign]
    setattr(http.MessageData, _MARK, True)


def installed() -> bool:
    return bool(getattr(http.MessageData, _MARK, False))
