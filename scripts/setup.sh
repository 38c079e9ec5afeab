#!/usr/bin/env bash
# Set up everything Sandgate needs on a fresh Debian machine (Python 3.12+, 3.13 preferred):
# idempotent.
#   scripts/setup.sh          the proxy: .venv with sandgate installed
#   scripts/setup.sh --test   also test tools: curl, iproute2, ..., the provider and Phoenix venvs
#   scripts/setup.sh --no-apt the proxy's .venv only, never apt (the fast lane; no root needed)
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
no_apt=0
[[ "${1:-}" == "--test" ]] && want_test=1
[[ "${1:-}" == "--no-apt" ]] && no_apt=1

# The interpreter: $PYTHON if set, else the newest suitable one found (scripts/python.sh).
# shellcheck source=scripts/python.sh
source scripts/python.sh
# Debian's python3 (3.13 on Debian 13) lacks venv/ensurepip until python3-venv is installed.
if ((!no_apt)) && [[ -z ${PYTHON:-} ]] && command -v python3 >/dev/null \
    && python3 -c 'import sys; sys.exit(sys.version_info < (3, 12))' \
    && ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
fi
PY=$(find_python) || exit 1
echo "== setup: Python $(python_ok "$PY") ($PY)"
need_apt=()
command -v curl >/dev/null || need_apt+=(curl)
if ((want_test)); then
  command -v ip >/dev/null || need_apt+=(iproute2)
  # nginx: a real virtual-host server for the round-2 routing tests (tests/support/nginx.py)
  command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || need_apt+=(nginx-light)
  # wget: a real client strict about framing and TLS shutdown (tests/integration/test_clients.py)
  command -v wget >/dev/null || need_apt+=(wget)
  # postgresql: a real database for the dynamic-secrets test (tests/integration/test_fleet_secrets.py:
  # OpenBao's database engine mints PostgreSQL users); initdb lives in /usr/lib/postgresql/*/bin
  compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need_apt+=(postgresql)
  # nodejs: Node's built-in fetch through the gateway mode (tests/integration/test_gateway.py)
  command -v node >/dev/null || need_apt+=(nodejs)
  # npm: the Node clients pinned by lock files below (tests/mcp-ts, tests/agents)
  command -v npm >/dev/null || need_apt+=(npm)
  # git: `git http-backend`, the smart-HTTP server of the client matrix (tests/integration/clients)
  command -v git >/dev/null || need_apt+=(git)
  # squid: the bench's CONNECT-tunnel baseline (tests/integration/test_bench.py runs bench/)
  command -v squid >/dev/null || [[ -x /usr/sbin/squid ]] || need_apt+=(squid)
  # redis-server: the fleet's shared state (tests/integration/test_fleet_state.py,
  # test_state_scripts.py; bench/state.py) and approvals shared by two proxies
  # (tests/integration/test_approvals.py)
  command -v redis-server >/dev/null || [[ -x /usr/bin/redis-server ]] || need_apt+=(redis-server)
  # chromium + chromium-driver: the web console's browser tests (tests/integration/test_console.py,
  # Selenium with Debian's Chromium and its chromedriver: no browser download)
  command -v chromium >/dev/null || need_apt+=(chromium)
  command -v chromedriver >/dev/null || need_apt+=(chromium-driver)
  # dig: a real DNS client against the policy DNS (tests/integration/test_dns.py)
  command -v dig >/dev/null || need_apt+=(dnsutils)
  # nft, go, openssl: transparent capture's nftables table and its clients with no proxy
  # setting, a Go program built offline and `openssl s_client` (tests/integration/test_transparent.py)
  command -v nft >/dev/null || [[ -x /usr/sbin/nft ]] || need_apt+=(nftables)
  command -v go >/dev/null || need_apt+=(golang-go)
  command -v openssl >/dev/null || need_apt+=(openssl)
  # rsyslog + its gtls driver: the syslog collector of tests/integration/test_audit_export.py
  [[ -x /usr/sbin/rsyslogd ]] || need_apt+=(rsyslog)
  compgen -G '/usr/lib/*/rsyslog/lmnsd_gtls.so' >/dev/null || need_apt+=(rsyslog-gnutls)
fi
if ((${#need_apt[@]} && !no_apt)); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# A venv built with another interpreter (an older Python, or before the move to 3.12+) is
# made again: its packages were built for that one.
fresh_venv .venv "$PY"
# Exactly the locked versions, each checked against its hash (requirements/dev.lock; the
# documented update command is in docs/development.md), then Sandgate itself without
# dependencies: nothing outside the lock file is installed.
stamp=.venv/.sandgate-installed
lock=requirements/dev.lock
if [[ ! -f $stamp || pyproject.toml -nt $stamp || $lock -nt $stamp ]]; then
  .venv/bin/pip install -q --require-hashes -r "$lock"
  .venv/bin/pip install -q --no-deps --no-build-isolation -e .
  touch "$stamp"
fi

if ((want_test)); then
  # The official SDK clients (anthropic, openai, google-genai, mcp, deepagents, ...) are in
  # .venv with the proxy since mitmproxy 12.3.1 (the `clients` extra, requirements/dev.lock).
  # A .venv-clients left from before is no longer used.
  # The TypeScript MCP SDK as a client (tests/integration/test_mcp.py): exactly the versions in
  # tests/mcp-ts/package-lock.json, reinstalled when the lock moves.
  if command -v npm >/dev/null; then
    lock=tests/mcp-ts/package-lock.json
    if [[ ! -f tests/mcp-ts/node_modules/.installed ]] || ! cmp -s "$lock" tests/mcp-ts/node_modules/.installed; then
      npm ci --prefix tests/mcp-ts --no-audit --no-fund --silent
      cp "$lock" tests/mcp-ts/node_modules/.installed
    fi
    # Real agent CLIs through `sandgate run` (tests/integration/test_agent_claude_code.py,
    # test_agent_split_clis.py): Claude Code, Codex, OpenCode and Gemini CLI at the versions in
    # tests/agents/package-lock.json (Claude Code's and OpenCode's postinstall put the native
    # binary of the platform package npm chose in place; Codex's comes in its platform
    # package), reinstalled when the lock moves.
    # (`npm install --no-save`, not `npm ci`: OpenCode lists a native package per platform as
    # optional, and the lock holds only this platform's, which `npm ci` calls out of sync; the
    # locked versions are what installs, and the lock is never rewritten)
    lock=tests/agents/package-lock.json
    if [[ ! -f tests/agents/node_modules/.installed ]] || ! cmp -s "$lock" tests/agents/node_modules/.installed; then
      npm install --prefix tests/agents --no-save --no-audit --no-fund --silent
      cp "$lock" tests/agents/node_modules/.installed
    fi
  fi
  # The hosted-sandbox provider SDKs (tests/integration/test_providers.py): their own venv.
  # In .venv they would choose the proxy's OpenTelemetry: daytona requires
  # opentelemetry-instrumentation-aiohttp-client, whose releases each pin one
  # opentelemetry-semantic-conventions beta (0.66b1), which holds opentelemetry-sdk at 1.45.1
  # below the 1.45.2 of requirements/proxy.lock (the image), so the dev lock would no longer be
  # the image's set. sandgate.providers comes from proxy/ on PYTHONPATH (standard library only).
  fresh_venv .venv-providers "$PY"
  pins=tests/requirements-providers.txt
  if [[ ! -f .venv-providers/.installed ]] || ! cmp -s "$pins" .venv-providers/.installed; then
    .venv-providers/bin/pip install -q -r "$pins"
    cp "$pins" .venv-providers/.installed
  fi
  # Arize Phoenix, a real OpenTelemetry collector (tests/integration/test_audit_export.py): its
  # own venv. arize-phoenix 20.26.1 requires anthropic<2 (the SDK tests use anthropic 2.x) and
  # authlib>=1.8 (the OAuth tests' server is held below 1.7): no set satisfies both.
  fresh_venv .venv-phoenix "$PY"
  pins=tests/requirements-phoenix.txt
  if [[ ! -f .venv-phoenix/.installed ]] || ! cmp -s "$pins" .venv-phoenix/.installed; then
    .venv-phoenix/bin/pip install -q -r "$pins"
    cp "$pins" .venv-phoenix/.installed
  fi
fi
