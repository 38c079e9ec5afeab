"""mitmproxy's addon manager with the hook lookup done once per event name, not once per event.

mitmproxy 12.3.1 dispatches every hook (a dozen per request, each followed by an `update` hook
for flows) by walking the whole addon chain: for each of ~35 addons a generator over its
sub-addons, a `getattr` for the hook name, and a context manager, whether or not the addon has
that hook. Profiled under keep-alive load this walk was about a tenth of Sandgate's CPU.

`CachedAddons` keeps what the walk finds (per event name: each top-level addon's callables, in
chain order) and rebuilds it whenever the chain can change: an addon registered or removed, the
chain cleared, options changed. Calls are the same as mitmproxy's, in the same order, with the
same error handling: each top-level addon's hooks run under mitmproxy's `safecall` (an exception
is logged and the next addon still runs), `AddonHalt` stops the event. The one difference is
asked for explicitly: addons that pinned options make inert get lifecycle hooks only
(`set_inert`, see speed.py).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

from mitmproxy import exceptions, flow, hooks, master
from mitmproxy.addonmanager import AddonManager, safecall, traverse

# mitmproxy's AddonManager is unannotated: calls into it carry no-untyped-call ignores.
Entry = tuple[Any, tuple[Callable[..., Any], ...]]
LIFECYCLE = frozenset({"load", "configure", "running", "done"})

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


class CachedAddons(AddonManager):
    def __init__(self, m: master.Master) -> None:
        super().__init__(m)  # type: ignore[no-untyped-call]
        self._hooks: dict[str, tuple[Entry, ...]] = {}
        self._inert: frozenset[int] = frozenset()  # id() of addons without per-flow hooks
        self._plain: dict[str, bool] = {}  # event name -> no handler is a coroutine function

    def set_inert(self, addons: set[Any]) -> None:
        """Addons whose hooks, other than the lifecycle ones, are no-ops (see speed.py)."""
        self._inert = frozenset(id(a) for a in addons)
        self._invalidate()

    def _invalidate(self) -> None:
        self._hooks.clear()
        self._plain.clear()

    def _configure_all(self, updated: Any) -> None:
        self._invalidate()
        super()._configure_all(updated)  # type: ignore[no-untyped-call]

    def register(self, addon: Any) -> Any:
        self._invalidate()
        try:
            return super().register(addon)  # type: ignore[no-untyped-call]
        finally:
            self._invalidate()

    def add(self, *addons: Any) -> None:
        super().add(*addons)  # type: ignore[no-untyped-call]
        self._invalidate()

    def remove(self, addon: Any) -> None:
        self._invalidate()
        super().remove(addon)  # type: ignore[no-untyped-call]
        self._invalidate()

    def clear(self) -> None:
        super().clear()  # type: ignore[no-untyped-call]
        self._invalidate()

    def _entries(self, name: str) -> tuple[Entry, ...]:
        found = self._hooks.get(name)
        if found is None:
            entries: list[Entry] = []
            for top in self.chain:
                funcs: list[Callable[..., Any]] = []
                for a in traverse([top]):
                    if name not in LIFECYCLE and id(a) in self._inert:
                        continue
                    func = getattr(a, name, None)
                    if not func or isinstance(func, types.ModuleType):
                        continue  # mitmproxy skips module imports named like a hook too
                    if not callable(func):
                        raise exceptions.AddonManagerError(
                            f"Addon handler {name} ({a}) not callable")
                    funcs.append(func)
                if funcs:
                    entries.append((top, tuple(funcs)))
            found = self._hooks[name] = tuple(entries)
        return found

    async def handle_lifecycle(self, event: hooks.Hook) -> None:
        """mitmproxy's: the hook, then `update` for a flow; no UpdateHook built when no addon
        has an `update` hook (trigger_event would return at once)."""
        message = event.args()[0]
        await self.trigger_event(event)
        if isinstance(message, flow.Flow) and self._entries("update"):
            await self.trigger_event(hooks.UpdateHook([message]))

    async def trigger_event(self, event: hooks.Hook) -> None:
        entries = self._entries(event.name)
        if not entries:
            return
        args = event.args()
        for _top, funcs in entries:
            try:
                with safecall():
                    for func in funcs:
                        res = func(*args)
                        if res is not None and inspect.isawaitable(res):
                            await res
            except exceptions.AddonHalt:
                return


    def plain(self, name: str) -> bool:
        """Does no handler of this event await anything (none is a coroutine function)?"""
        found = self._plain.get(name)
        if found is None:
            found = self._plain[name] = not any(
                inspect.iscoroutinefunction(f) for _top, funcs in self._entries(name)
                for f in funcs)
        return found

    def call_now(self, event: hooks.Hook) -> bool:
        """`handle_lifecycle` without awaiting, when nothing in it awaits (synchooks.py):
        the event's handlers and, for a flow, the `update` hook's, called as trigger_event
        calls them. False (and nothing called) when a handler is a coroutine function."""
        args = event.args()
        is_flow = len(args) == 1 and isinstance(args[0], flow.Flow)
        if not self.plain(event.name) or (is_flow and not self.plain("update")):
            return False
        self._call(event.name, args)
        if is_flow:
            self._call("update", [args])
        return True

    def _call(self, name: str, args: Any) -> None:
        for _top, funcs in self._entries(name):
            try:
                with safecall():
                    for func in funcs:
                        res = func(*args)
                        if res is not None and inspect.isawaitable(res):
                            self._plain[name] = False  # a plain function gave a coroutine
                            if inspect.iscoroutine(res):
                                res.close()
                            raise exceptions.AddonManagerError(
                                f"Addon handler {name} ({func}) returned an awaitable")
            except exceptions.AddonHalt:
                return


def install(m: master.Master) -> CachedAddons:
    """Give a freshly built master (no addons yet) the cached manager."""
    old = m.addons
    if len(old):
        raise RuntimeError("install the cached addon manager before adding addons")
    m.options.changed.disconnect(old._configure_all)
    m.addons = CachedAddons(m)
    return m.addons
