"""What Sandgate's patches of mitmproxy (and h11, h2, wsproto) internals were written against.

Each module under sandgate.addons that replaces or wraps code of these libraries names that code
(`SOURCES`: "module:Qualified.name") and pins its SHA-256 (`SOURCE_SHA256`); one unit test per
patch (tests/unit/test_patch_sources.py) fails when the source changes, so an upgrade is read
and the patch re-checked, not trusted. The source is read from the installed file (its AST),
not from the live objects: after `install()` those are Sandgate's wrappers.

`check_version()` runs at start (sandgate.runner): a mitmproxy other than `MITMPROXY_VERSION`
is refused with a message saying what to install.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from collections.abc import Iterable
from functools import cache
from importlib import metadata

# The one mitmproxy every patch was checked against (pyproject.toml pins the same).
MITMPROXY_VERSION = "12.3.1"


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


def digest(refs: Iterable[str]) -> str:
    return hashlib.sha256(sources(refs).encode()).hexdigest()


def installed_version() -> str | None:
    try:
        return metadata.version("mitmproxy")
    except metadata.PackageNotFoundError:
        return None


def check_version() -> None:
    """Refuse to run on a mitmproxy other than the one the patches were checked against."""
    have = installed_version()
    if have != MITMPROXY_VERSION:
        raise RuntimeError(
            f"Sandgate needs mitmproxy {MITMPROXY_VERSION}, found {have or 'none'}: its patches "
            "of mitmproxy internals (sandgate.addons) were checked against that version only. "
            "Reinstall from the lock file (scripts/setup.sh, or pip install --require-hashes "
            "-r requirements/proxy.lock)")
