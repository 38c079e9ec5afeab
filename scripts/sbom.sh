#!/usr/bin/env bash
# The SBOM (CycloneDX 1.6, JSON) of a Python environment: every installed distribution with its
# version and package URL, Sandgate (from pyproject.toml) as the root component.
#   scripts/sbom.sh [PYTHON [OUT]]    default: .venv/bin/python -> sbom/sandgate-python.cdx.json
#   scripts/sbom.sh --audit [PYTHON]  also check it for known vulnerabilities (pip-audit, against
#                                     PyPI's vulnerability data: needs that service reachable;
#                                     docs/development.md says where this runs and where not)
set -euo pipefail
cd "$(dirname "$0")/.."
audit=0
if [[ ${1:-} == --audit ]]; then audit=1; shift; fi
py=${1:-.venv/bin/python}
out=${2:-sbom/sandgate-python.cdx.json}
tools=$(dirname "$0")/../.venv/bin
[[ -x $tools/cyclonedx-py ]] || tools=$(dirname "$py")
mkdir -p "$(dirname "$out")"
"$tools/cyclonedx-py" environment --pyproject pyproject.toml --output-reproducible \
  --of JSON -o "$out" "$py"
echo "== sbom: $out ($(grep -c '"bom-ref"' "$out") components)"
if ((audit)); then
  "$tools/pip-audit" --progress-spinner off --strict --path \
    "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
fi
