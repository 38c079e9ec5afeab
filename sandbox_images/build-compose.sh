#!/usr/bin/env bash
# Build every image of docker-compose.yml from the local base image (no registry, no network in
# `docker build`):
#   1. sandbox_images/build.sh: the agent's SDK wheelhouse + sandgate-agent:dev, sandgate-bash-tool:dev
#   2. the Sandgate wheelhouse sandbox_images/sandgate/wheels (gitignored): `pip wheel` of this
#      repository (a copy of pyproject.toml, README.md and proxy/) and all its dependencies, for
#      the host's .venv CPython (3.13, the same as the image's Debian 13 python3)
#   3. the iptables .debs of the sandbox-firewall image, sandbox_images/firewall/debs (gitignored):
#      from apt's cache on the host, else `apt-get download` (skipped when the base image already
#      has iptables, or when the host has no apt: the image build then uses apt-get itself)
#   4. `<compose> build` (with docker-compose.ci.yml too when --ci is given)
#
#   sandbox_images/build-compose.sh [--ci] [--replicas] [--no-download]
#
# --replicas builds docker-compose.replicas.yml instead (Sandgate replicas behind HAProxy; step 3
# then also fetches haproxy's and redis-server's .debs for sandbox_images/{haproxy,redis}/debs).
#
# The compose command is `docker compose` (v2 plugin) if it works, else `docker-compose` (v1;
# Debian's package, installed with apt-get when missing and running as root).
# Environment: BASE_IMAGE (default sandgate-base:trixie), PYTHON (whose pip builds the wheels).
# Prints `COMPOSE=<command>` on its last line.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
WHEELS=$HERE/sandgate/wheels
export BASE_IMAGE=${BASE_IMAGE:-sandgate-base:trixie}
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}  # the classic builder: no buildx plugin needed
export COMPOSE_DOCKER_CLI_BUILD=${COMPOSE_DOCKER_CLI_BUILD:-0}

ci=0 download=1 replicas=0
for arg in "$@"; do
  case $arg in
    --ci) ci=1 ;;
    --replicas) replicas=1 ;;
    --no-download) download=0 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "build-compose.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

t_all=$SECONDS
log() { echo "== build-compose.sh: $*"; }
die() { echo "build-compose.sh: error: $*" >&2; exit 1; }

find_compose() {
  if docker compose version >/dev/null 2>&1; then echo "docker compose"; return 0; fi
  if command -v docker-compose >/dev/null 2>&1; then echo "docker-compose"; return 0; fi
  return 1
}

# --- 0. compose -----------------------------------------------------------------------------------
if ! COMPOSE=$(find_compose); then
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    die "neither \`docker compose\` nor \`docker-compose\` is installed"
  fi
  log "installing docker-compose (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
  COMPOSE=$(find_compose) || die "docker-compose installed but not usable"
fi
log "compose: $COMPOSE ($($COMPOSE version --short 2>/dev/null || $COMPOSE version | head -1))"

# --- 1. sandbox images ------------------------------------------------------------------------------
build_args=()
((download)) || build_args+=(--no-download)
"$HERE/build.sh" "${build_args[@]}"

# --- 2. sandgate wheelhouse -------------------------------------------------------------------------
pick_python() {
  local c
  for c in "${PYTHON:-}" "$REPO/.venv/bin/python" python3; do
    [[ -n $c ]] || continue
    if "$c" -m pip --version >/dev/null 2>&1; then echo "$c"; return 0; fi
  done
  return 1
}
# pip's noise about unusable find-links from a machine-wide pip.conf
quiet_pip() { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }
t=$SECONDS
mkdir -p "$WHEELS"
py=$(pick_python) || die "no python with pip (set PYTHON, or install python3-pip)"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
# Build from a copy: no build/ or egg-info in the work tree, no stray files in the wheel.
cp "$REPO/pyproject.toml" "$REPO/README.md" "$src/"
tar -C "$REPO" --exclude=__pycache__ --exclude='*.pyc' -cf - proxy | tar -C "$src" -xf -
rm -f "$WHEELS"/sandgate-*.whl
pip_args=(--quiet --disable-pip-version-check wheel --wheel-dir "$WHEELS" --find-links "$WHEELS")
if ((download)); then
  log "pip wheel sandgate + locked dependencies -> $WHEELS (pip of $py)"
  # The dependencies exactly as locked, each file checked against its hash
  # (requirements/proxy.lock); the image installs from this wheelhouse only (--no-index).
  "$py" -m pip "${pip_args[@]}" --require-hashes -r "$REPO/requirements/proxy.lock" \
    2> >(quiet_pip >&2) || die "pip wheel of requirements/proxy.lock failed"
  # setuptools too: the build backend, so that --no-download can build without an index.
  "$py" -m pip "${pip_args[@]}" "setuptools>=68" 2> >(quiet_pip >&2) || die "pip wheel failed"
  "$py" -m pip "${pip_args[@]}" --no-deps --no-build-isolation "$src" 2> >(quiet_pip >&2) \
    || die "pip wheel of sandgate failed"
else
  log "pip wheel sandgate --no-index (the dependencies must already be in $WHEELS)"
  "$py" -m pip "${pip_args[@]}" --no-index "$src[openbao]" 2> >(quiet_pip >&2) \
    || die "pip wheel --no-index failed (run once without --no-download)"
fi
rm -rf "$src"
trap - EXIT
log "wheelhouse ready: $(find "$WHEELS" -maxdepth 1 -name '*.whl' | wc -l) wheels ($((SECONDS - t)) s)"

# --- 3. .debs for the images that add Debian packages to the base (no network in `docker build`) --
base_codename() {  # the Debian release of the base image (cached)
  [[ -n ${_base_codename:-} ]] || _base_codename=$(docker run --rm --entrypoint sh "$BASE_IMAGE" \
    -c '. /etc/os-release; echo "${VERSION_CODENAME:-}"' 2>/dev/null || true)
  echo "$_base_codename"
}
# fetch_debs DIR CHECK PKG...: fill DIR with PKG's .debs from apt's cache or `apt-get download`,
# unless CHECK (a shell command) succeeds in the base image (then DIR is emptied: nothing needed).
fetch_debs() {
  local dir=$1 check=$2 name t=$SECONDS; shift 2
  name=$(basename "$(dirname "$dir")")
  mkdir -p "$dir"
  if docker run --rm --entrypoint sh "$BASE_IMAGE" -c "$check" >/dev/null 2>&1; then
    log "$name: the base image has what it needs: no .debs"
    rm -f "$dir"/*.deb
    return 0
  fi
  # A host of another Debian release than the base image (a bookworm host, the trixie base):
  # the .debs come from the base image's own apt, which resolves the packages' dependencies
  # for its release (the first package named is the one wanted; apt adds what it needs).
  if [[ $(base_codename) != "$(. /etc/os-release 2>/dev/null; echo "${VERSION_CODENAME:-}")" ]]; then
    ((download)) || { [[ -n $(find "$dir" -maxdepth 1 -name '*.deb') ]] && return 0; \
      die "$name .debs missing in $dir (run once without --no-download)"; }
    log "$name: apt-get --download-only $1 in $BASE_IMAGE"
    rm -f "$dir"/*.deb
    docker run --rm -v "$dir:/out" --entrypoint sh "$BASE_IMAGE" -c \
      "apt-get update -qq && apt-get install -y -qq --no-install-recommends --download-only \
       -o Dir::Cache::archives=/out '$1' >/dev/null && rm -rf /out/partial /out/lock" \
      || die "$name: apt-get --download-only $1 in $BASE_IMAGE failed"
    log "$name .debs ready: $(find "$dir" -maxdepth 1 -name '*.deb' | wc -l) ($((SECONDS - t)) s)"
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    log "$name: no apt-get on this host: its image build uses apt-get itself"
    return 0
  fi
  local pkg ver file alt f missing=()
  for pkg in "$@"; do
    ver=$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ { print $2 }')
    [[ -n $ver && $ver != "(none)" ]] || die "apt knows no package $pkg (run apt-get update)"
    file="${pkg}_${ver//:/%3a}_$(dpkg --print-architecture).deb"
    alt="${pkg}_${ver//:/%3a}_all.deb"
    for f in "$file" "$alt"; do
      if [[ -f $dir/$f ]]; then continue 2; fi
      if [[ -f /var/cache/apt/archives/$f ]]; then cp "/var/cache/apt/archives/$f" "$dir/"; continue 2; fi
    done
    missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    ((download)) || die "$name .debs missing in $dir: ${missing[*]} (run once without --no-download)"
    log "$name: apt-get download ${missing[*]}"
    (cd "$dir" && apt-get download -qq "${missing[@]}" 2>&1 | grep -v -e 'unsandboxed' >&2 || true)
  fi
  log "$name .debs ready: $(find "$dir" -maxdepth 1 -name '*.deb' | wc -l) ($((SECONDS - t)) s)"
}
# What iptables and haproxy need beyond a minimal Debian (the base image's suite).
fetch_debs "$HERE/firewall/debs" 'command -v iptables-nft && command -v iptables-legacy' \
  iptables libip4tc2 libip6tc2 libxtables12 libmnl0 libnetfilter-conntrack3 libnfnetlink0 \
  libnftnl11 netbase
# nft for `sandgate sandbox capture --pod`: the Kubernetes init container of transparent capture
# (deploy/kubernetes/examples/sandbox-pod-transparent.yaml) runs the sandgate image.
fetch_debs "$HERE/sandgate/debs" 'command -v nft' \
  nftables libnftables1 libedit2 libbsd0 libmd0 libgmp10 libjansson4 libmnl0 libnftnl11 \
  libxtables12
if ((replicas)); then
  fetch_debs "$HERE/haproxy/debs" 'command -v haproxy' \
    haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1 lsb-base
  # the fleet's shared state (sandgate run --state): sandbox_images/redis
  fetch_debs "$HERE/redis/debs" 'command -v redis-server' \
    redis-server redis-tools libjemalloc2 liblzf1 libatomic1
fi

# --- 4. compose build ---------------------------------------------------------------------------------
t=$SECONDS
if ((replicas)); then
  files=(-f "$REPO/docker-compose.replicas.yml")
  ((ci)) && files+=(-f "$REPO/docker-compose.replicas.ci.yml")
else
  files=(-f "$REPO/docker-compose.yml")
  ((ci)) && files+=(-f "$REPO/docker-compose.ci.yml")
fi
log "$COMPOSE ${files[*]} build"
out=$(mktemp)
# shellcheck disable=SC2086  # COMPOSE is one or two words
if ! (cd "$REPO" && $COMPOSE "${files[@]}" build --quiet) >"$out" 2>&1; then
  cat "$out" >&2; rm -f "$out"; die "compose build failed"
fi
grep -v -i -e 'legacy builder' -e 'buildx' -e '^ *$' "$out" || true
rm -f "$out"
log "images built ($((SECONDS - t)) s); done ($((SECONDS - t_all)) s)"
echo "COMPOSE=$COMPOSE"
