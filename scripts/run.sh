#!/usr/bin/env bash
# Set up and run Sandgate with the shipped policies. Without VAULT_ADDR it starts an embedded
# OpenBao dev server with demo secrets. Extra arguments go to `sandgate run`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/sandgate run --policies policies --confdir .sandgate "$@"
