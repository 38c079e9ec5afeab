#!/usr/bin/env bash
# Build the sandbox images from the local base image (no image registry; the bash-tool image's
# Debian packages come from the archive its apt sources name, in a layer the builder caches):
#   sandgate-agent:dev      pattern 1: agent with the anthropic + openai SDKs, placeholder keys,
#                           and the split (a `tool` user, the runner: docs/pattern1.md)
#   sandgate-bash-tool:dev  pattern 2: the clients agent-host tool calls run (bash, curl, wget, git,
#                           python3 + pip/uv/requests/httpx/aiohttp, node + npm, go, cargo; see
#                           README "Clients"): Debian packages from the base image's apt sources
#                           (a cached layer), the Python ones from its wheelhouse
#                           (sandbox_images/bash-tool/wheels, gitignored, filled like the agent's)
#
# The agent's SDKs come from a wheelhouse (sandbox_images/agent/wheels, gitignored) that this
# script fills on the host with `pip download` for the image's Python (cp313, glibc linux). It is
# reused when it already holds both SDKs; --refresh downloads again. If PyPI is unreachable and
# the wheelhouse is empty the agent image is built without the SDKs (a warning says so), unless
# SANDGATE_REQUIRE_SDK=1 makes that an error (for the bash-tool wheelhouse too).
#
#   sandbox_images/build.sh [--refresh] [--no-download] [agent|bash-tool ...]
#
# Environment: BASE_IMAGE (default sandgate-base:trixie), AGENT_TAG, BASH_TOOL_TAG, PYTHON
# (the interpreter whose pip downloads the wheels), SANDBOX_PY_VERSION (default 313).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
BASE_IMAGE=${BASE_IMAGE:-sandgate-base:trixie}
AGENT_TAG=${AGENT_TAG:-sandgate-agent:dev}
BASH_TOOL_TAG=${BASH_TOOL_TAG:-sandgate-bash-tool:dev}
PY_VERSION=${SANDBOX_PY_VERSION:-313}
WHEELS=$HERE/agent/wheels
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}  # the classic builder: no buildx plugin needed

refresh=0 download=1 targets=()
for arg in "$@"; do
  case $arg in
    --refresh) refresh=1 ;;
    --no-download) download=0 ;;
    agent|bash-tool) targets+=("$arg") ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done
((${#targets[@]})) || targets=(agent bash-tool)

t_all=$SECONDS
log() { echo "== build.sh: $*"; }
die() { echo "build.sh: error: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || die "Docker is not running or not reachable (run .ci/docker-setup.sh)"
docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 \
  || die "base image '$BASE_IMAGE' not found (build it with .ci/docker-setup.sh)"

have_sdk_wheels() {
  compgen -G "$WHEELS/anthropic-*.whl" >/dev/null && compgen -G "$WHEELS/openai-*.whl" >/dev/null \
    && compgen -G "$WHEELS/deepagents-*.whl" >/dev/null
}

pick_python() {
  local c
  for c in "${PYTHON:-}" "$REPO/.venv/bin/python" python3; do
    [[ -n $c ]] || continue
    if "$c" -m pip --version >/dev/null 2>&1; then echo "$c"; return 0; fi
  done
  return 1
}

prepare_wheelhouse() {
  mkdir -p "$WHEELS"
  if ((refresh)); then rm -f "$WHEELS"/*.whl; fi
  if have_sdk_wheels; then
    log "wheelhouse has the SDKs ($(ls "$WHEELS"/*.whl | wc -l) wheels; --refresh to update)"
    return 0
  fi
  ((download)) || { log "WARNING: --no-download and the wheelhouse lacks the SDKs"; return 0; }
  local py tmpvenv=""
  if ! py=$(pick_python); then
    tmpvenv=$(mktemp -d)
    python3 -m venv "$tmpvenv" || die "no pip available (install python3-venv)"
    py=$tmpvenv/bin/python
  fi
  local arch
  arch=$(uname -m)
  local t=$SECONDS
  log "pip download anthropic openai deepagents -> $WHEELS (cp$PY_VERSION, manylinux $arch; pip of $py)"
  # Wheels for the image, not for the host: its Python (3.13) and glibc (2.41; manylinux_2_36
  # and older wheels run on it).
  if "$py" -m pip download --quiet --disable-pip-version-check --dest "$WHEELS" \
      --only-binary=:all: --implementation cp --python-version "$PY_VERSION" \
      --abi "cp$PY_VERSION" --abi abi3 --abi none \
      --platform "manylinux_2_36_$arch" --platform "manylinux2014_$arch" \
      --platform "manylinux_2_17_$arch" --platform any \
      anthropic openai deepagents; then
    log "wheelhouse ready: $(ls "$WHEELS"/*.whl | wc -l) wheels ($((SECONDS - t)) s)"
  else
    log "WARNING: pip download failed ($((SECONDS - t)) s)"
  fi
  [[ -z $tmpvenv ]] || rm -rf "$tmpvenv"
  if ! have_sdk_wheels; then
    [[ ${SANDGATE_REQUIRE_SDK:-0} == 1 ]] && die "the wheelhouse lacks the anthropic/openai SDKs"
    log "WARNING: building $AGENT_TAG WITHOUT the anthropic/openai SDKs"
  fi
}

TOOL_WHEELS=$HERE/bash-tool/wheels
TOOL_PACKAGES=(requests httpx aiohttp uv)
have_tool_wheels() {
  local p
  for p in "${TOOL_PACKAGES[@]}"; do compgen -G "$TOOL_WHEELS/$p-*.whl" >/dev/null || return 1; done
}

prepare_tool_wheelhouse() {
  mkdir -p "$TOOL_WHEELS"
  if ((refresh)); then rm -f "$TOOL_WHEELS"/*.whl; fi
  if have_tool_wheels; then
    log "bash-tool wheelhouse has ${TOOL_PACKAGES[*]} ($(ls "$TOOL_WHEELS"/*.whl | wc -l) wheels)"
    return 0
  fi
  ((download)) || { log "WARNING: --no-download and the bash-tool wheelhouse is incomplete"; return 0; }
  local py arch t=$SECONDS
  py=$(pick_python) || die "no pip available on the host (install python3-venv)"
  arch=$(uname -m)
  log "pip download ${TOOL_PACKAGES[*]} -> $TOOL_WHEELS (cp$PY_VERSION, manylinux $arch)"
  "$py" -m pip download --quiet --disable-pip-version-check --dest "$TOOL_WHEELS" \
      --only-binary=:all: --implementation cp --python-version "$PY_VERSION" \
      --abi "cp$PY_VERSION" --abi abi3 --abi none \
      --platform "manylinux_2_36_$arch" --platform "manylinux2014_$arch" \
      --platform "manylinux_2_17_$arch" --platform any \
      "${TOOL_PACKAGES[@]}" || log "WARNING: pip download failed ($((SECONDS - t)) s)"
  if ! have_tool_wheels; then
    [[ ${SANDGATE_REQUIRE_SDK:-0} == 1 ]] && die "the bash-tool wheelhouse lacks ${TOOL_PACKAGES[*]}"
    log "WARNING: building $BASH_TOOL_TAG without ${TOOL_PACKAGES[*]}"
  fi
}

# The split's in-sandbox code (docs/pattern1.md) is Sandgate's package sandgate.pattern1 (standard
# library only): copied into the agent's build context (sandbox_images/agent/pattern1, gitignored).
copy_pattern1() {
  rm -rf "$HERE/agent/pattern1"
  mkdir -p "$HERE/agent/pattern1"
  cp "$REPO"/proxy/sandgate/pattern1/*.py "$HERE/agent/pattern1/"
}

build() {  # build DIR TAG
  local t=$SECONDS
  log "docker build $2 from $BASE_IMAGE"
  docker build --quiet --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$2" "$1" >/dev/null
  log "built $2 ($((SECONDS - t)) s)"
}

for target in "${targets[@]}"; do
  case $target in
    agent) prepare_wheelhouse; copy_pattern1; build "$HERE/agent" "$AGENT_TAG" ;;
    bash-tool) prepare_tool_wheelhouse; build "$HERE/bash-tool" "$BASH_TOOL_TAG" ;;
  esac
done
log "done ($((SECONDS - t_all)) s)"
