#!/usr/bin/env bash
# What bench/run.py needs beyond the project's venv (scripts/setup.sh): squid, from Debian.
set -euo pipefail
if ! command -v squid >/dev/null && [[ ! -x /usr/sbin/squid ]]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq squid >/dev/null
  # the package starts a system squid where it can; the bench runs its own
  (service squid stop || true) >/dev/null 2>&1
fi
