#!/usr/bin/env python3
"""The SBOM (CycloneDX 1.6, JSON) of a Docker image: every Debian package (from the image's dpkg
database) and every Python distribution installed in it (each interpreter and venv under /opt,
/usr and /usr/local), with package URLs; the image itself as the root component.

    scripts/sbom-image.py IMAGE [OUT]    default OUT: sbom/IMAGE.cdx.json (':' and '/' -> '-')

It runs the image once (`docker run --rm --network none`, a shell as the image's user: it only
reads the dpkg database and the interpreters' metadata) and needs only the standard library and
the docker CLI. scripts/sbom.sh writes the Python environment's SBOM; scripts/test.sh writes
one per image after the Docker tests (docs/development.md, "The SBOM").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

# Printed inside the image: the Debian release, one line per package (name, version,
# architecture), then one JSON line per Python distribution of each interpreter found.
PROBE = r"""
. /etc/os-release 2>/dev/null; echo "OS	${ID:-unknown}	${VERSION_ID:-}"
dpkg-query -W -f='DEB	${Package}	${Version}	${Architecture}	${db:Status-Abbrev}\n' 2>/dev/null
for py in /usr/bin/python3 /usr/local/bin/python3 /opt/*/bin/python3; do
  [ -x "$py" ] || continue
  "$py" -c '
import importlib.metadata as md, json, sys
for d in md.distributions():
    print("PY\t" + json.dumps({"name": d.metadata["Name"], "version": d.version,
                               "path": sys.prefix}))
' 2>/dev/null
done
"""


@dataclass(frozen=True)
class Package:
    kind: str  # "deb" or "pypi"
    name: str
    version: str
    arch: str = ""
    where: str = ""  # pypi: the interpreter's prefix


def parse_probe(text: str) -> tuple[tuple[str, str], list[Package]]:
    """(os id, version id) and the packages from PROBE's output; only installed debs ("ii")."""
    os_id: tuple[str, str] = ("unknown", "")
    packages: list[Package] = []
    for line in text.splitlines():
        tag, _, rest = line.partition("\t")
        if tag == "OS":
            ident, _, version = rest.partition("\t")
            os_id = (ident, version)
        elif tag == "DEB":
            name, version, arch, status = [*rest.split("\t"), "", "", "", ""][:4]
            if status.strip() == "ii":
                packages.append(Package("deb", name, version, arch))
        elif tag == "PY":
            d = json.loads(rest)
            if d.get("name") and d.get("version"):
                packages.append(Package("pypi", d["name"], d["version"], where=d["path"]))
    return os_id, packages


def purl(pkg: Package, os_id: tuple[str, str]) -> str:
    if pkg.kind == "pypi":
        name = re.sub(r"[-_.]+", "-", pkg.name).lower()  # PEP 503, as the purl spec asks
        return f"pkg:pypi/{name}@{quote(pkg.version, safe='')}"
    distro = f"{os_id[0]}-{os_id[1]}" if os_id[1] else os_id[0]
    return (f"pkg:deb/{quote(os_id[0], safe='')}/{quote(pkg.name, safe='')}"
            f"@{quote(pkg.version, safe='')}?arch={quote(pkg.arch, safe='')}"
            f"&distro={quote(distro, safe='')}")


def bom(image: str, image_id: str, os_id: tuple[str, str], packages: list[Package]) -> dict:
    """The CycloneDX 1.6 document. A distribution installed in several venvs at one version is
    one component whose properties name every location."""
    components: dict[str, dict] = {}
    for pkg in packages:
        ref = purl(pkg, os_id)
        comp = components.setdefault(ref, {
            "type": "library", "bom-ref": ref, "name": pkg.name, "version": pkg.version,
            "purl": ref, "properties": []})
        if pkg.where:
            comp["properties"].append({"name": "sandgate:python-prefix", "value": pkg.where})
    for comp in components.values():
        if not comp["properties"]:
            del comp["properties"]
    root_ref = f"image:{image}"
    return {
        "$schema": "http://cyclonedx.org/schema/bom-1.6.schema.json",
        "bomFormat": "CycloneDX",
        "specVersion": "1.6",
        # reproducible: the same image gives the same document
        "serialNumber": f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, image_id or image)}",
        "version": 1,
        "metadata": {
            "component": {"type": "container", "bom-ref": root_ref, "name": image,
                          "version": image_id,
                          "properties": [{"name": "sandgate:os",
                                          "value": " ".join(p for p in os_id if p)}]},
        },
        "components": sorted(components.values(), key=lambda c: c["bom-ref"]),
        "dependencies": [{"ref": root_ref, "dependsOn": sorted(components)}],
    }


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    image = argv[0]
    out = Path(argv[1] if len(argv) > 1 else f"sbom/{re.sub(r'[:/]', '-', image)}.cdx.json")
    inspect = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", image],
                             capture_output=True, text=True)
    if inspect.returncode != 0:
        print(f"sbom-image: no image {image!r} ({inspect.stderr.strip()}): build it first "
              "(sandbox_images/build.sh, build-compose.sh or .ci/docker-setup.sh)", file=sys.stderr)
        return 1
    run = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "/bin/sh",
                          image, "-c", PROBE], capture_output=True, text=True, timeout=300)
    os_id, packages = parse_probe(run.stdout)
    if run.returncode != 0 or not packages:
        print(f"sbom-image: reading {image} failed (exit {run.returncode}, {len(packages)} "
              f"packages):\n{run.stderr[-2000:]}", file=sys.stderr)
        return 1
    doc = bom(image, inspect.stdout.strip(), os_id, packages)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    debs = sum(p.kind == "deb" for p in packages)
    print(f"== sbom: {out} ({len(doc['components'])} components: {debs} Debian packages, "
          f"Python distributions from {len({p.where for p in packages if p.where})} "
          f"interpreter(s); {' '.join(p for p in os_id if p)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
