#!/usr/bin/env bash
# Every check: ruff, mypy --strict, the policy fixtures and the whole pytest suite (unit and
# integration: real OpenBao, real TLS upstreams, real network namespaces, real Docker).
#
#   scripts/test.sh             what CI runs (as root: installs apt packages, starts dockerd)
#   scripts/test.sh --fast      ruff, mypy, policy fixtures, unit tests: no root, Docker or apt
#   scripts/test.sh [--fast] -- PYTEST_ARGS...   extra pytest arguments (e.g. -k scrub)
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
fast=0
if [[ "${1:-}" == "--fast" ]]; then
  fast=1
  shift
fi
[[ "${1:-}" == "--" ]] && shift
if ((fast)); then
  scripts/setup.sh --no-apt
else
  scripts/setup.sh --test
  # CI must never build an agent image without its SDKs.
  export SANDGATE_REQUIRE_SDK=1
  .ci/docker-setup.sh
fi
echo "== setup took $((SECONDS - t0)) s"
.venv/bin/ruff check proxy tests
.venv/bin/mypy
.venv/bin/sandgate check policies
.venv/bin/sandgate lint --strict policies
if ((fast)); then
  .venv/bin/python -m pytest -p no:cacheprovider -q -n auto -m unit "$@"
else
  .venv/bin/python -m pytest -p no:cacheprovider -q "$@"
fi
echo "== all checks took $((SECONDS - t0)) s"
