"""mitm/speedups/speed.py (4, 5): hook arguments and option reads without per-call reflection give
exactly what mitmproxy's own code gives."""

from __future__ import annotations

import dataclasses

from mitmproxy import hooks, options
from mitmproxy.proxy import server_hooks
from mitmproxy.proxy.layers.http import HttpConnectHook, HttpRequestHook
from mitmproxy.test import tflow

from sandgate.mitm.speedups import speed


def test_hook_args_are_mitmproxy_s_for_every_hook_class() -> None:
    flow = tflow.tflow()
    data = server_hooks.ServerConnectionHookData(flow.server_conn, flow.client_conn)
    made = [HttpConnectHook(flow), HttpRequestHook(flow), hooks.UpdateHook([flow, flow]),
            server_hooks.ServerConnectedHook(data), hooks.RunningHook(),
            hooks.ConfigureHook({"a", "b"})]
    for h in made:
        want = [getattr(h, f.name) for f in dataclasses.fields(h)]  # mitmproxy's Hook.args
        assert speed._hook_args(h) == want
        assert all(a is b for a, b in zip(speed._hook_args(h), want, strict=True))
    # every hook mitmproxy knows, by class: the same field names in the same order
    for cls in hooks.all_hooks.values():
        if dataclasses.is_dataclass(cls):
            names = [f.name for f in dataclasses.fields(cls)]
            obj = object.__new__(cls)
            for n in names:
                object.__setattr__(obj, n, n)
            assert speed._hook_args(obj) == names


def test_option_reads_are_unchanged_and_containers_still_copied() -> None:
    opts = options.Options()
    before = {name: getattr(opts, name) for name in opts.keys()}
    speed.install()
    speed.install()
    assert speed.installed()
    after = {name: getattr(opts, name) for name in opts.keys()}
    assert after == before
    opts.update(ignore_hosts=["a.example"], listen_host="127.0.0.1")
    got = opts.ignore_hosts
    got.append("b.example")  # a caller's copy: the option itself is not changed
    assert opts.ignore_hosts == ["a.example"]
    assert opts.ignore_hosts is not opts.ignore_hosts
    assert opts.listen_host == "127.0.0.1"
    opts.update(listen_host="")
    assert opts.listen_host == ""  # set, then read: the set value, not a stale one
    opts.reset()
    assert {name: getattr(opts, name) for name in opts.keys()} == before
