"""The one list of patches of mitmproxy (h11, h2, wsproto, pyOpenSSL) internals
(sandgate.mitm.registry.PATCHES): each pins the source of what it replaces, every patching module
is in it, it installs in its order, and nothing else runs on other library versions.

One named test per patch (`test_source_is_pinned[NAME]`): when an upgrade changes a source, the
tests of exactly the patches that depend on it fail, and each is re-checked against the new code
(then its pins are updated), never trusted.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import master, options
from mitmproxy.proxy import server

from sandgate.limits import LimitsConfig
from sandgate.mitm import pinning, registry
from sandgate.mitm.registry import PATCHES, Patch, Pin
from sandgate.mitm.speedups import dispatch, synchooks

MITM = Path(pinning.__file__).parent
REPO = MITM.parents[2]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_source_is_pinned(patch: Patch) -> None:
    assert patch.pins, f"{patch.name} names no source"
    assert not patch.changed(), (
        f"{patch.name}: the source of {', '.join(patch.changed())} changed; re-check the patch "
        f"against it (print(registry.patch({patch.name!r}).sources())) and update its pins")


def _failing(patches: tuple[Patch, ...] = PATCHES) -> list[str]:
    """The ids of the `test_source_is_pinned` cases that fail now."""
    return [f"test_source_is_pinned[{p.name}]" for p in patches if p.changed()]


def _one_byte_changed(monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    real = pinning.source

    def source(ref: str) -> str:
        text = real(ref)
        if ref != target:
            return text
        i = len(text) // 2
        return text[:i] + chr(ord(text[i]) ^ 1) + text[i + 1:]

    monkeypatch.setattr(pinning, "source", source)


def test_one_changed_byte_fails_exactly_one_named_test(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _failing() == []
    _one_byte_changed(monkeypatch, "mitmproxy.proxy.layers.http:HttpLayer._handle_event")
    assert _failing() == ["test_source_is_pinned[coalesce]"]


def test_a_changed_shared_source_fails_each_patch_that_pins_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    target = "mitmproxy.proxy.server:ConnectionHandler.open_connection"
    _one_byte_changed(monkeypatch, target)
    assert _failing() == [f"test_source_is_pinned[{n}]"
                          for n in ("wirelimits", "dialguard", "upstreampool")]
    assert [p.name for p in PATCHES if target in p.targets] == [
        "wirelimits", "dialguard", "upstreampool"]


def test_pins_are_well_formed_and_named_once() -> None:
    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names))
    for p in PATCHES:
        assert p.module.__name__ == f"sandgate.mitm.{p.kind}.{p.name}"
        assert p.kind in ("guards", "speedups")
        assert p.reason and "\n" not in p.reason and len(p.reason) <= 90
        assert len(p.targets) == len(set(p.targets))
        for pin in p.pins:
            assert re.fullmatch(r"[0-9a-f]{64}", pin.sha256), pin
    assert registry.patch("wirelimits").name == "wirelimits"
    with pytest.raises(LookupError, match="no patch named 'nothing'"):
        registry.patch("nothing")


def _copied(original: str, copy: str) -> bool:
    """Every statement line of `original`'s body is in `copy`, in order (the copy adds steps)."""
    def body(src: str) -> list[str]:
        # (the copy says `server.X` for names the original has imported, and lints: no f"")
        lines = [line.strip().replace("server.", "").replace('f"', '"')
                 for line in src.splitlines()[1:]]
        return [line for line in lines if line and not line.startswith(("#", '"""'))]
    rest = iter(body(copy))
    return all(line in rest for line in body(original))


def test_synchooks_server_event_is_mitmproxys_with_one_step_added() -> None:
    target = "mitmproxy.proxy.server:ConnectionHandler.server_event"
    assert target in registry.patch("synchooks").targets
    assert _copied(pinning.source(target), inspect.getsource(synchooks.server_event))


def _patches_library_code(path: Path) -> bool:
    """The module's `install()` replaces an attribute of a class or module (`X.name = ...`,
    `setattr(X, ...)` other than its own install mark)."""
    tree = ast.parse(path.read_text())
    for fn in tree.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "install"):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute)
                                                    for t in node.targets):
                return True
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "setattr" and len(node.args) == 3 \
                    and not (isinstance(node.args[2], ast.Constant)
                             and node.args[2].value is True):
                return True
    return False


def test_every_module_that_patches_a_library_is_in_the_list() -> None:
    # a new patch must name and pin what it replaces in PATCHES (and so gets its named test)
    patching = {p.stem for p in MITM.rglob("*.py") if _patches_library_code(p)}
    assert patching == {p.name for p in PATCHES}
    assert {p.stem for p in (MITM / "guards").glob("*.py")} | {
        p.stem for p in (MITM / "speedups").glob("*.py")} == patching | {"__init__", "parking"}


def test_a_changed_source_changes_the_pin(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "sg_fake_lib.py"
    pkg.write_text("class Layer:\n    def step(self):\n        return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pin = Pin("sg_fake_lib:Layer.step", "")
    before = pin.current()
    assert "return 1" in pinning.sources([pin.target])
    pkg.write_text("class Layer:\n    def step(self):\n        return 2\n")
    pinning._module_source.cache_clear()
    sys.modules.pop("sg_fake_lib", None)
    assert pin.current() != before
    assert Pin(pin.target, before) != Pin(pin.target, pin.current())


def test_an_unknown_source_is_named() -> None:
    with pytest.raises(LookupError, match="no 'nothing_here'"):
        pinning.source("mitmproxy.proxy.server:ConnectionHandler.nothing_here")


def _locked(name: str) -> str:
    text = (REPO / "requirements" / "proxy.lock").read_text()
    found = re.search(rf"^{re.escape(name.lower())}==(\S+)", text, re.M)
    assert found, name
    return found.group(1)


def test_the_installed_libraries_are_the_pinned_ones() -> None:
    pinning.check_version()
    assert pinning.installed_version() == pinning.MITMPROXY_VERSION
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"mitmproxy=={pinning.MITMPROXY_VERSION}"' in pyproject
    # every library a pin names is version-checked, at the version the lock file installs
    libraries = {pin.target.split(".")[0].split(":")[0] for p in PATCHES for pin in p.pins}
    assert {"OpenSSL" if d == "pyOpenSSL" else d for d in pinning.VERSIONS} == libraries
    for dist, version in pinning.VERSIONS.items():
        assert _locked(dist) == version, dist


def _versions(**changed: str) -> Callable[[str], str | None]:
    real = pinning.installed_version

    def installed_version(dist: str = "mitmproxy") -> str | None:
        return changed.get(dist, real(dist))

    return installed_version


def test_another_mitmproxy_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pinning, "installed_version", _versions(mitmproxy="11.0.2"))
    with pytest.raises(RuntimeError, match=r"needs mitmproxy 12\.3\.1, found 11\.0\.2"):
        pinning.check_version()
    from sandgate.cli import main

    # `sandgate run` refuses before anything starts (2: the CLI's usage and setup errors)
    assert main(["run", "--policies", "policies"]) == 2


@pytest.mark.parametrize("dist", ["h11", "h2", "wsproto", "pyOpenSSL"])
def test_another_h11_h2_wsproto_or_pyopenssl_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                        dist: str) -> None:
    monkeypatch.setattr(pinning, "installed_version", _versions(**{dist: "0.0.1"}))
    with pytest.raises(RuntimeError, match=rf"needs {dist} [0-9.]+, found 0\.0\.1: its patches"):
        pinning.check_version()


def _inner(fn: Any) -> Any:
    """What a wrapper installed by a patch calls: its `original` (closure) or `__wrapped__`."""
    if hasattr(fn, "__wrapped__"):
        return fn.__wrapped__
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return None
    for name, cell in zip(code.co_freevars, cells, strict=True):
        if name.startswith("original"):
            return cell.cell_contents
    return None


def _chain(fn: Any) -> list[str]:
    """The patches wrapping `fn`, outermost first (each named by its module)."""
    out = []
    while fn is not None and getattr(fn, "__module__", "").startswith("sandgate.mitm."):
        out.append(fn.__module__.rsplit(".", 1)[1])
        fn = _inner(fn)
    return out


def _installed() -> dispatch.CachedAddons:
    async def go() -> dispatch.CachedAddons:
        m = master.Master(options.Options())
        return registry.install_all(m, LimitsConfig())

    return asyncio.run(go())


def test_install_all_wraps_in_the_lists_order() -> None:
    assert isinstance(_installed(), dispatch.CachedAddons)
    for p in PATCHES:
        if p.only_in_workers:  # a single process keeps mitmproxy's own code there
            continue
        assert p.name == "dispatch" or p.module.installed(), p.name
    # open_connection is wrapped three times: the later entry is the outer wrapper
    assert _chain(server.ConnectionHandler.open_connection) == [
        "upstreampool", "dialguard", "wirelimits"]
    # and every wrapped attribute of a pinned class follows the list, whoever wraps it
    order = {p.name: i for i, p in enumerate(PATCHES)}
    seen = 0
    for p in PATCHES:
        for target in p.targets:
            module, _, qualname = target.partition(":")
            obj: Any = sys.modules.get(module) or __import__(module, fromlist=["_"])
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
            chain = _chain(obj)
            assert chain == sorted(chain, key=order.__getitem__, reverse=True), (target, chain)
            seen += len(chain) > 1
    assert seen >= 3  # several attributes wrapped by more than one patch were checked


def test_a_worker_installs_the_workers_patches_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from mitmproxy.proxy import mode_servers

    from sandgate.mitm.speedups import sharedport

    for cls in (mode_servers.RegularInstance, mode_servers.Socks5Instance,
                mode_servers.ReverseInstance, mode_servers.TransparentInstance):
        monkeypatch.setattr(cls, "listen", mode_servers.AsyncioServerInstance.listen)
        monkeypatch.setattr(cls, sharedport._MARK, False, raising=False)
    workers_only = [p for p in PATCHES if p.only_in_workers]
    assert [p.name for p in workers_only] == ["sharedport"]
    _installed()
    assert not sharedport.installed()  # a single process: mitmproxy's own bind

    async def go() -> None:
        registry.install_all(master.Master(options.Options()), LimitsConfig(), worker=True)

    asyncio.run(go())
    assert sharedport.installed()


def test_a_patch_checked_at_start_refuses_other_code(monkeypatch: pytest.MonkeyPatch) -> None:
    wscontrol = registry.patch("wscontrol")
    assert wscontrol.checked_at_start
    _one_byte_changed(monkeypatch, wscontrol.targets[0])
    with pytest.raises(RuntimeError, match="control-frame patch was written for"):
        _installed()
