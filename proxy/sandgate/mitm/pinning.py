"""What Sandgate's patches of mitmproxy (and h11, h2, wsproto, pyOpenSSL) internals were written
against: the library versions, and the source of each object a patch replaces.

Each patch in sandgate.mitm.registry names that code ("module:Qualified.name") and pins the
SHA-256 of its source; one unit test per patch (tests/unit/test_mitm_registry.py) fails when the
source changes, so an upgrade is read and the patch re-checked, not trusted. The source is read
from the installed file (its AST), not from the live objects: after `install()` those are
Sandgate's wrappers.

`check_version()` runs at start (sandgate.mitm.registry.install_all, and `sandgate run` before
anything else): a version of one of these libraries other than `VERSIONS` is refused with a
message saying what to install.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable
from functools import cache
from importlib import metadata

# The one mitmproxy every patch was checked against (pyproject.toml pins the same).
MITMPROXY_VERSION = "12.3.1"
# Every library whose internals a patch replaces, at the version the patches were checked
# against (requirements/proxy.lock locks the same).
VERSIONS = {
    "mitmproxy": MITMPROXY_VERSION,
    "h11": "0.16.0",
    "h2": "4.4.1",
    "wsproto": "1.3.2",
    "pyOpenSSL": "26.4.0",
}


@cache
def _module_source(module: str) -> tuple[str, ast.Module]:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise LookupError(f"module {module} is not installed")
    with open(spec.origin, encoding="utf-8") as f:
        text = f.read()
    return text, ast.parse(text)


def source(ref: str) -> str:
    """The source text of `ref` ("package.module:Class.function", or a module-level name)."""
    module, _, qualname = ref.partition(":")
    text, node = _module_source(module)
    found: ast.AST = node
    for part in qualname.split("."):
        for child in ast.iter_child_nodes(found):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
                    and child.name == part:
                found = child
                break
            if isinstance(child, ast.Assign | ast.AnnAssign) and part in _targets(child):
                found = child
                break
        else:
            raise LookupError(f"{ref}: no {part!r} in {module}")
    segment = ast.get_source_segment(text, found)
    assert segment is not None
    return segment


def _targets(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def sources(refs: Iterable[str]) -> str:
    """Each source of `refs`, in order, under a line naming it."""
    return "".join(f"# {ref}\n{source(ref)}\n" for ref in refs)


def installed_version(dist: str = "mitmproxy") -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_version() -> None:
    """Refuse to run on a mitmproxy (h11, h2, wsproto, pyOpenSSL) other than the one the
    patches were checked against."""
    for dist, want in VERSIONS.items():
        have = installed_version(dist)
        if have != want:
            raise RuntimeError(
                f"Sandgate needs {dist} {want}, found {have or 'none'}: its patches of {dist} "
                "internals (sandgate.mitm) were checked against that version only. Reinstall "
                "from the lock file (scripts/setup.sh, or pip install --require-hashes "
                "-r requirements/proxy.lock)")
