#!/usr/bin/env bash
# Make a Docker engine and the local sandbox base image available: idempotent, fresh Debian
# (12 or 13) as root. No image registry is needed: the base image is built with debootstrap.
#
#   1. apt-get install docker.io debootstrap docker-compose   (only what is missing)
#   2. start dockerd in the background          (only if `docker info` fails; waits <= 60 s)
#   3. build sandgate-base:trixie             (only if the image does not exist)
#
# Environment: SANDGATE_BASE_IMAGE (default sandgate-base:trixie), DEBIAN_MIRROR
# (default: the Debian archive this machine's apt sources name), DOCKERD_LOG (default /var/log/sandgate-dockerd.log),
# DOCKERD_WAIT (seconds, default 60), DOCKERD_ARGS (extra dockerd arguments, word-split; e.g. a
# second engine: -H unix:///x.sock --data-root ... with DOCKER_HOST=unix:///x.sock).
set -euo pipefail

BASE_IMAGE=${SANDGATE_BASE_IMAGE:-sandgate-base:trixie}
# The Debian archive apt already uses here (first `deb` source that serves the suite's main
# archive, not -security): debootstrap fetches from the same place as apt-get.
apt_mirror() {
  local f uri
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f $f ]] || continue
    uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z+]+:\/\//) { print $i; exit } }' \
      "$f" | grep -v -- '-security' | head -n 1)
    [[ -n $uri ]] && { echo "$uri"; return 0; }
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    uri=$(awk '/^URIs:/ { print $2 }' "$f" | grep -v -- '-security' | head -n 1)
    [[ -n $uri ]] && { echo "$uri"; return 0; }
  done
  return 1
}
MIRROR=${DEBIAN_MIRROR:-$(apt_mirror || true)}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/sandgate-dockerd.log}
DOCKERD_WAIT=${DOCKERD_WAIT:-60}
# Debian 13: Python 3.13, what Sandgate's lock files and wheelhouse are built for
SUITE=trixie
PACKAGES=python3,python3-pip,python3-venv,curl,ca-certificates,git,iproute2,bind9-dnsutils,iptables

t_all=$SECONDS
log() { echo "== docker-setup: $*"; }
die() { echo "docker-setup: error: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (installs packages, starts dockerd, runs debootstrap)"

# --- 1. packages -------------------------------------------------------------------------------
t=$SECONDS
need_apt=()
command -v dockerd >/dev/null 2>&1 || need_apt+=(docker.io)
command -v docker >/dev/null 2>&1 || need_apt+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need_apt+=(debootstrap)
# Compose: v2 plugin if present; Debian bookworm ships only v1 (docker-compose), trixie both.
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1 \
  || need_apt+=(docker-compose)
if ((${#need_apt[@]})); then
  mapfile -t need_apt < <(printf '%s\n' "${need_apt[@]}" | sort -u)
  log "installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
log "packages ok ($((SECONDS - t)) s)"

# --- 2. dockerd --------------------------------------------------------------------------------
t=$SECONDS
if ! docker info >/dev/null 2>&1; then
  if [[ -z ${DOCKERD_ARGS:-} ]] && pgrep -x dockerd >/dev/null 2>&1; then
    log "dockerd is running but not answering yet; waiting"
  else
    log "starting dockerd (log: $DOCKERD_LOG)"
    mkdir -p "$(dirname "$DOCKERD_LOG")"
    # setsid + nohup: dockerd outlives this script and the CI step that ran it.
    # shellcheck disable=SC2086  # DOCKERD_ARGS is deliberately word-split
    setsid nohup dockerd ${DOCKERD_ARGS:-} >>"$DOCKERD_LOG" 2>&1 </dev/null &
    log "dockerd pid $!"
  fi
  deadline=$((SECONDS + DOCKERD_WAIT))
  until docker info >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      echo "--- last lines of $DOCKERD_LOG:" >&2
      tail -n 30 "$DOCKERD_LOG" >&2 || true
      die "dockerd did not become ready within ${DOCKERD_WAIT} s"
    fi
    sleep 0.5
  done
fi
log "docker ready: server $(docker version --format '{{.Server.Version}}' 2>/dev/null) ($((SECONDS - t)) s)"

# --- 3. base image -----------------------------------------------------------------------------
t=$SECONDS
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  log "base image $BASE_IMAGE exists"
else
  [[ -n $MIRROR ]] || die "no Debian archive in this machine's apt sources; set DEBIAN_MIRROR"
  rootfs=$(mktemp -d /var/tmp/sandgate-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  log "debootstrap $SUITE ($PACKAGES) from $MIRROR into $rootfs"
  if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" \
      >"$rootfs.log" 2>&1; then
    tail -n 30 "$rootfs.log" >&2 || true
    die "debootstrap failed (full log: $rootfs.log)"
  fi
  rm -f "$rootfs.log"
  log "debootstrap done ($((SECONDS - t)) s); importing"
  # Keep the image small: apt lists and caches are not needed to run sandboxes.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  log "built $BASE_IMAGE ($((SECONDS - t)) s)"
fi

log "done ($((SECONDS - t_all)) s)"
