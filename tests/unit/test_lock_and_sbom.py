"""The hash-locked dependency sets (requirements/*.lock, scripts/lock.sh) and the SBOM
(scripts/sbom.sh): every dependency locked to one version with its hashes, and the SBOM of the
running environment naming the mitmproxy Sandgate's patches were checked against."""

from __future__ import annotations

import importlib.util
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


def _sbom_image():  # scripts/sbom-image.py, a script: loaded by path
    spec = importlib.util.spec_from_file_location("sbom_image", REPO / "scripts" / "sbom-image.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)
    return module


PROBE_OUTPUT = "\n".join([
    "OS\tdebian\t13",
    "DEB\tpython3.13\t3.13.5-2+deb13u5\tamd64\tii ",
    "DEB\tlibc6\t2:2.41-12\tamd64\tii ",
    "DEB\tgone\t1.0\tamd64\trc ",  # removed, only its configuration left: not in the image
    'PY\t{"name": "mitmproxy", "version": "12.3.1", "path": "/opt/sandgate"}',
    'PY\t{"name": "Typing_Extensions", "version": "4.16.0", "path": "/opt/sandgate"}',
    'PY\t{"name": "typing-extensions", "version": "4.16.0", "path": "/usr"}',
    "some noise a shell printed",
])


def test_an_image_sbom_is_valid_cyclonedx_with_package_urls() -> None:
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    mod = _sbom_image()
    os_id, packages = mod.parse_probe(PROBE_OUTPUT)
    assert os_id == ("debian", "13")
    doc = mod.bom("sandgate:dev", "sha256:abc", os_id, packages)
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(json.dumps(doc)) is None
    assert doc["metadata"]["component"]["type"] == "container"
    purls = {c["purl"]: c for c in doc["components"]}
    assert set(purls) == {
        "pkg:deb/debian/python3.13@3.13.5-2%2Bdeb13u5?arch=amd64&distro=debian-13",
        "pkg:deb/debian/libc6@2%3A2.41-12?arch=amd64&distro=debian-13",
        "pkg:pypi/mitmproxy@12.3.1",
        "pkg:pypi/typing-extensions@4.16.0",
    }
    # one component for a distribution in two interpreters, naming both
    where = {p["value"] for p in purls["pkg:pypi/typing-extensions@4.16.0"]["properties"]}
    assert where == {"/opt/sandgate", "/usr"}
    # the same image gives the same document
    assert doc == mod.bom("sandgate:dev", "sha256:abc", os_id, packages)
