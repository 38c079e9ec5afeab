#!/usr/bin/env bash
# Set up and run every check: ruff, mypy, the policy fixtures and the whole pytest suite
# (unit and integration: real OpenBao, real TLS upstreams, real network namespaces, real Docker).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
scripts/setup.sh --test
# CI must never build an agent image without its SDKs.
export SANDGATE_REQUIRE_SDK=1
.ci/docker-setup.sh
echo "== setup took $((SECONDS - t0)) s"
.venv/bin/ruff check proxy tests
.venv/bin/mypy
.venv/bin/sandgate check policies
.venv/bin/python -m pytest -p no:cacheprovider -q "$@"
echo "== all checks took $((SECONDS - t0)) s"
