"""The hash-locked dependency sets (requirements/*.lock, scripts/lock.sh) and the SBOM
(scripts/sbom.sh): every dependency locked to one version with its hashes, and the SBOM of the
running environment naming the mitmproxy Sandgate's patches were checked against."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sandgate.mitm import pinning

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
_ENTRY = re.compile(
    r"^([A-Za-z0-9_.-]+)==(\S+) \\\n((?:    --hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)", re.M)


def locked(name: str) -> dict[str, tuple[str, list[str]]]:
    text = (REPO / "requirements" / name).read_text()
    return {canonicalize_name(m[1]): (m[2], re.findall(r"sha256:([0-9a-f]{64})", m[3]))
            for m in _ENTRY.finditer(text)}


def wanted(extras: tuple[str, ...]) -> set[str]:
    """The names pyproject.toml asks for with `extras` (sandgate[...] expanded)."""
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    todo = list(extras)
    seen: set[str] = set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for spec in project["optional-dependencies"][extra]:
            req = Requirement(spec)
            if req.name == "sandgate":
                todo += sorted(req.extras)
            else:
                reqs.append(req)
    return {canonicalize_name(r.name) for r in reqs
            if r.marker is None or r.marker.evaluate({"extra": ""})}


@pytest.mark.parametrize(("lock", "extras"), [("proxy.lock", ("openbao",)), ("dev.lock", ("dev",))])
def test_every_dependency_is_locked_with_hashes(lock: str, extras: tuple[str, ...]) -> None:
    entries = locked(lock)
    text = (REPO / "requirements" / lock).read_text()
    missing = wanted(extras) - entries.keys()
    assert not missing, f"{lock} lacks {sorted(missing)}: run scripts/lock.sh"
    # every requirement line is an exact pin followed by its hashes (--require-hashes installs it)
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith((" ", "#"))]
    assert len(lines) == len(entries), [ln for ln in lines if "==" not in ln]
    assert all(hashes for _, hashes in entries.values())
    assert "file://" not in text and "sandgate @" not in text  # no local paths, no self
    assert entries["mitmproxy"][0] == pinning.MITMPROXY_VERSION
    assert entries["h11"][0] >= "0.16.0"  # CVE-2025-43859: chunked bodies


def test_the_proxy_lock_is_the_dev_locks_subset() -> None:
    # what the image runs was tested: the same version of each package in both sets
    proxy, dev = locked("proxy.lock"), locked("dev.lock")
    assert {n: v for n, (v, _) in proxy.items()} == {n: dev[n][0] for n in proxy}


def test_the_sbom_lists_this_mitmproxy(tmp_path: Path) -> None:
    out = tmp_path / "sbom.json"
    subprocess.run([str(REPO / "scripts" / "sbom.sh"), sys.executable, str(out)], check=True,
                   capture_output=True, timeout=300)
    bom = json.loads(out.read_text())
    assert bom["bomFormat"] == "CycloneDX"
    assert bom["metadata"]["component"]["name"] == "sandgate"
    versions = {c["name"].lower(): c["version"] for c in bom["components"]}
    assert versions["mitmproxy"] == pinning.MITMPROXY_VERSION
    assert versions["mitmproxy"].startswith("12.")
    assert all(c.get("purl", "").startswith("pkg:pypi/") for c in bom["components"])
