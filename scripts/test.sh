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
# The SBOM of the environment under test (sbom/, CycloneDX; docs/development.md "The SBOM")
scripts/sbom.sh
.venv/bin/ruff check proxy tests
.venv/bin/mypy
.venv/bin/sandgate check policies
.venv/bin/sandgate lint --strict policies
.venv/bin/sandgate check policies/agents   # the agent templates (docs/agents.md)
.venv/bin/sandgate lint --strict policies/agents
# The documentation site (into site/, gitignored): a broken link or anchor, or a page missing
# from the nav, fails it.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
# The unit lane runs on every core. The integration tests bind fixed loopback addresses
# (127.0.0.2:443, ...): each xdist worker runs in a network namespace of its own
# (tests/support/netns-python), so they run side by side; a file stays on one worker (its
# module fixtures are shared). The soak tests measure load, so they run alone (in a namespace of
# their own); the Docker tests share one dockerd and its bridge, so they run one at a time in
# the host's namespace.
lane() {  # lane NAME PYTEST_ARGS...: pytest's status, where "no test selected" (5) counts as 0
  local rc=0 t=$SECONDS
  .venv/bin/python -m pytest -p no:cacheprovider -q "${@:2}" || rc=$?
  if ((rc == 5)); then rc=0; else ran=1; fi
  echo "== $1 tests: exit $rc, $((SECONDS - t)) s ($((SECONDS - t0)) s so far)"
  return $rc
}
ran=0
status=0
if ((!fast)); then
  # The Docker lane (the longest) starts first and runs beside the unit lane and the integration
  # workers: it uses the host's namespace and the workers their own, so they share no address,
  # and Docker tests spend much of their time waiting on image builds and containers. Its
  # output is printed when it ends.
  dlog=$(mktemp)
  (
    drc=0
    lane docker -m docker "$@" >"$dlog" 2>&1 || drc=$?
    echo "$drc $ran" >"$dlog.status"
  ) &
  dpid=$!
fi
lane unit -n auto -m unit "$@" || status=$?
if ((!fast)); then
  workers=${SANDGATE_TEST_WORKERS:-3}
  lane integration -m "integration and not docker and not soak" --dist loadfile \
    --tx "$workers*popen//python=tests/support/netns-python" "$@" || status=$?
  wait "$dpid" || true
  cat "$dlog"
  read -r drc dran <"$dlog.status" || { drc=1; dran=0; }
  ((drc == 0)) || status=$drc
  ((dran)) && ran=1
  rm -f "$dlog" "$dlog.status"
  # The SBOM of each image the Docker lane built (sbom/IMAGE.cdx.json, CycloneDX: its Debian
  # packages and Python distributions; docs/development.md "The SBOM")
  for image in sandgate:dev sandgate-agent:dev sandgate-bash-tool:dev sandgate-base:trixie \
      sandgate-firewall:dev sandgate-haproxy:dev sandgate-redis:dev; do
    docker image inspect "$image" >/dev/null 2>&1 || continue
    .venv/bin/python scripts/sbom-image.py "$image" || status=1
  done
  # The soak tests measure load: alone, last.
  lane soak -m soak "$@" || status=$?
fi
if ((status == 0 && !ran)); then
  echo "no test was selected" >&2
  status=5
fi
echo "== all checks took $((SECONDS - t0)) s"
exit $status
