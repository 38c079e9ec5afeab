"""Each patch of mitmproxy (h11, h2, wsproto, pyOpenSSL) internals pins the source it replaces.

One named test per patch: when an upgrade changes that source, exactly that test fails, and the
patch is re-checked against the new code (then its SOURCE_SHA256 is updated), never trusted.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path
from types import ModuleType

import pytest

from sandgate.mitm import pinning
from sandgate.mitm.guards import (
    admission,
    corrections,
    dialguard,
    dialorigin,
    readable,
    socks5,
    tunnels,
    wirelimits,
    wscontrol,
)
from sandgate.mitm.speedups import (
    coalesce,
    dispatch,
    handshake,
    headerlookup,
    relay,
    speed,
    synchooks,
    upstreampool,
    writes,
)

MITM = Path(pinning.__file__).parent


def _pinned(module: ModuleType) -> None:
    assert module.SOURCES, f"{module.__name__} names no source"
    assert module.source_digest() == module.SOURCE_SHA256, (
        f"{module.__name__}: the source it patches changed; re-check the patch against it "
        f"(print({module.__name__}.sources())) and update SOURCE_SHA256")


def test_admission_source_is_pinned() -> None:
    _pinned(admission)


def test_coalesce_source_is_pinned() -> None:
    _pinned(coalesce)


def test_dialguard_source_is_pinned() -> None:
    _pinned(dialguard)


def test_dialorigin_source_is_pinned() -> None:
    _pinned(dialorigin)


def test_dispatch_source_is_pinned() -> None:
    _pinned(dispatch)


def test_handshake_source_is_pinned() -> None:
    _pinned(handshake)


def test_headerlookup_source_is_pinned() -> None:
    _pinned(headerlookup)


def test_corrections_source_is_pinned() -> None:
    _pinned(corrections)


def test_readable_source_is_pinned() -> None:
    _pinned(readable)


def test_relay_source_is_pinned() -> None:
    _pinned(relay)


def test_socks5_source_is_pinned() -> None:
    _pinned(socks5)


def test_speed_source_is_pinned() -> None:
    _pinned(speed)


def test_synchooks_source_is_pinned() -> None:
    _pinned(synchooks)


def test_tunnels_source_is_pinned() -> None:
    _pinned(tunnels)


def test_upstreampool_source_is_pinned() -> None:
    _pinned(upstreampool)


def test_wirelimits_source_is_pinned() -> None:
    _pinned(wirelimits)


def test_writes_source_is_pinned() -> None:
    _pinned(writes)


def test_wscontrol_source_is_pinned() -> None:
    _pinned(wscontrol)


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
    assert _copied(pinning.source(synchooks.SOURCES[0]), inspect.getsource(
        synchooks.server_event))


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


def test_every_module_that_patches_a_library_pins_its_source() -> None:
    # a new patch must name and pin what it replaces, and get its named test above
    tested = {name.removeprefix("test_").removesuffix("_source_is_pinned")
              for name in globals() if name.endswith("_source_is_pinned")}
    patching = {p.stem for p in MITM.rglob("*.py") if _patches_library_code(p)}
    assert patching == tested
    for name in tested:
        module = globals()[name]
        assert isinstance(module.SOURCE_SHA256, str) and len(module.SOURCE_SHA256) == 64


def test_a_changed_source_changes_the_digest(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "sg_fake_lib.py"
    pkg.write_text("class Layer:\n    def step(self):\n        return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    refs = ("sg_fake_lib:Layer.step",)
    before = pinning.digest(refs)
    assert "return 1" in pinning.sources(refs)
    pkg.write_text("class Layer:\n    def step(self):\n        return 2\n")
    pinning._module_source.cache_clear()
    sys.modules.pop("sg_fake_lib", None)
    assert pinning.digest(refs) != before


def test_an_unknown_source_is_named() -> None:
    with pytest.raises(LookupError, match="no 'nothing_here'"):
        pinning.source("mitmproxy.proxy.server:ConnectionHandler.nothing_here")


def test_the_installed_mitmproxy_is_the_pinned_one() -> None:
    pinning.check_version()
    assert pinning.installed_version() == pinning.MITMPROXY_VERSION
    pyproject = (MITM.parents[2] / "pyproject.toml").read_text()
    assert f'"mitmproxy=={pinning.MITMPROXY_VERSION}"' in pyproject


def test_another_mitmproxy_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pinning, "installed_version", lambda: "11.0.2")
    with pytest.raises(RuntimeError, match=r"needs mitmproxy 12\.3\.1, found 11\.0\.2"):
        pinning.check_version()
    from sandgate.cli import main

    # `sandgate run` refuses before anything starts (2: the CLI's usage and setup errors)
    assert main(["run", "--policies", "policies"]) == 2
