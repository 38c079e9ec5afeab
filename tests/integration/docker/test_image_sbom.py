"""The SBOM of each image (scripts/sbom-image.py): read from the real images, Debian 13 and
Python 3.13 inside, and the Sandgate image's Python packages exactly requirements/proxy.lock."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.docker.conftest import REPO

pytestmark = [pytest.mark.docker, pytest.mark.integration]


def image_sbom(image: str, tmp_path: Path) -> tuple[dict, dict[str, dict[str, str]]]:
    """The document, and {kind: {name: version}} (kind "deb" or "pypi")."""
    out = tmp_path / "sbom.json"
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "sbom-image.py"), image,
                          str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(out.read_text())
    by_kind: dict[str, dict[str, str]] = {"deb": {}, "pypi": {}}
    for c in doc["components"]:
        kind = c["purl"].split("/", 1)[0].removeprefix("pkg:")
        name = re.sub(r"[-_.]+", "-", c["name"]).lower() if kind == "pypi" else c["name"]
        by_kind[kind][name] = c["version"]
    return doc, by_kind


@pytest.mark.parametrize(("image", "expected"), [
    ("sandgate-bash-tool:dev", {"deb": {"npm", "nodejs", "golang-go", "cargo"},
                                "pypi": {"requests", "httpx", "aiohttp", "uv"}}),
    ("sandgate-agent:dev", {"deb": {"python3.13"}, "pypi": {"anthropic", "openai"}}),
])
def test_a_sandbox_images_sbom(docker_client, tmp_path: Path, image: str,
                               expected: dict[str, set[str]]) -> None:
    doc, found = image_sbom(image, tmp_path)
    assert doc["metadata"]["component"]["name"] == image
    assert doc["metadata"]["component"]["properties"][0]["value"] == "debian 13"
    assert found["deb"]["python3.13"].startswith("3.13.")
    for kind, names in expected.items():
        assert names <= found[kind].keys(), (kind, sorted(names - found[kind].keys()))
