#!/usr/bin/env bash
# Host firewall for the compose sandbox network, installed by the one-shot service
# `sandbox-firewall` (network_mode: host, cap_add NET_ADMIN): idempotent, run at every `up`.
#
#   host INPUT from the bridge          DROP everything (IPv4 and IPv6): no host service answers
#                                       the sandboxes, not at the gateway, not at any address
#   bridged sandbox -> sandbox traffic  DROP (DOCKER-USER, IPv4; FORWARD, IPv6), except new TCP
#                                       connections to the proxy (PROXY_ADDR:PROXY_PORT) and the
#                                       packets of connections already accepted (conntrack)
#
# Docker's own `enable_icc=false` cannot be used: Sandgate itself is a container on the bridge.
# Filtering bridged traffic with iptables needs br_netfilter (net.bridge.bridge-nf-call-iptables
# = 1; Docker loads it): the script refuses to report success without it.
#
# Environment: SANDGATE_SBX_BRIDGE (the bridge name, com.docker.network.bridge.name),
# SANDGATE_SBX_SUBNET, SANDGATE_PROXY_ADDR, SANDGATE_PROXY_PORT (ports: 8080,8081). The rules match the bridge by
# name, so they may be installed before the bridge exists and survive `down`/`up`. Remove them:
# this script with SANDGATE_FIREWALL_REMOVE=1.
set -euo pipefail

BRIDGE=${SANDGATE_SBX_BRIDGE:?SANDGATE_SBX_BRIDGE is required}
SUBNET=${SANDGATE_SBX_SUBNET:?SANDGATE_SBX_SUBNET is required}
PROXY_ADDR=${SANDGATE_PROXY_ADDR:?SANDGATE_PROXY_ADDR is required}
PROXY_PORT=${SANDGATE_PROXY_PORT:?SANDGATE_PROXY_PORT is required}
IN=SG-IN-$BRIDGE
FWD=SG-FWD-$BRIDGE
log() { echo "sandbox-firewall: $*"; }
die() { echo "sandbox-firewall: error: $*" >&2; exit 1; }

[[ ${#FWD} -le 28 ]] || die "bridge name too long for a chain name: $BRIDGE"
[[ $PROXY_PORT =~ ^[0-9]+(,[0-9]+)*$ ]] || die "SANDGATE_PROXY_PORT is not a port (or ports, comma-separated): $PROXY_PORT"
# One rule per port (the proxy, and pattern 1's role listeners: docs/pattern1.md).
PORT_RULES=()
for port in ${PROXY_PORT//,/ }; do
  PORT_RULES+=("-s $SUBNET -d $PROXY_ADDR/32 -o $BRIDGE -p tcp -m tcp --dport $port -m conntrack --ctstate NEW -j RETURN")
done

# The backend Docker uses (its DOCKER-USER chain is there): nft on current Debian, or legacy.
V4= V6=
for b in nft legacy; do
  if "iptables-$b" -w -n -L DOCKER-USER >/dev/null 2>&1; then V4=iptables-$b V6=ip6tables-$b; break; fi
done
[[ -n $V4 ]] || die "Docker's DOCKER-USER chain not found (iptables-nft, iptables-legacy): is this
the Docker host's network namespace (network_mode: host) and Docker's iptables integration on?"

# chain <tool> <name> <rule>...: replace the chain's rules in one transaction (no open moment).
chain() {
  local tool=$1 name=$2; shift 2
  {
    echo "*filter"
    echo ":$name - [0:0]"
    local r
    for r in "$@"; do echo "-A $name $r"; done
    echo "COMMIT"
  } | "$tool-restore" -w --noflush
}
# jump <tool> <from> <name> <match...>: insert `-j name` at the top of <from> once.
jump() {
  local tool=$1 from=$2 name=$3; shift 3
  "$tool" -w -C "$from" "$@" -j "$name" 2>/dev/null || "$tool" -w -I "$from" 1 "$@" -j "$name"
}
unjump() {
  local tool=$1 from=$2 name=$3; shift 3
  while "$tool" -w -D "$from" "$@" -j "$name" 2>/dev/null; do :; done
}

if [[ ${SANDGATE_FIREWALL_REMOVE:-0} == 1 ]]; then
  unjump "$V4" INPUT "$IN" -i "$BRIDGE"; unjump "$V6" INPUT "$IN" -i "$BRIDGE"
  unjump "$V4" DOCKER-USER "$FWD" -i "$BRIDGE"; unjump "$V6" FORWARD "$FWD" -i "$BRIDGE"
  for t in "$V4" "$V6"; do
    for c in "$IN" "$FWD"; do "$t" -w -F "$c" 2>/dev/null || true; "$t" -w -X "$c" 2>/dev/null || true; done
  done
  log "removed ($V4)"
  exit 0
fi

bnf=/proc/sys/net/bridge/bridge-nf-call-iptables
[[ -r $bnf && $(cat "$bnf") == 1 ]] || die "$bnf is not 1 (br_netfilter not loaded?): bridged
sandbox-to-sandbox traffic would bypass iptables. Run 'modprobe br_netfilter' on the host."

# Host side: nothing from the bridge is accepted by the host.
chain "$V4" "$IN" "-m comment --comment \"sandgate: no host service for $SUBNET\" -j DROP"
jump "$V4" INPUT "$IN" -i "$BRIDGE"
chain "$V6" "$IN" "-m comment --comment \"sandgate: no host service for the sandboxes\" -j DROP"
jump "$V6" INPUT "$IN" -i "$BRIDGE"

# Bridged traffic: only to the proxy port (and the rest of connections already accepted).
chain "$V4" "$FWD" \
  "-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN" \
  "${PORT_RULES[@]}" \
  "-m comment --comment \"sandgate: sandboxes reach only $PROXY_ADDR:$PROXY_PORT\" -j DROP"
jump "$V4" DOCKER-USER "$FWD" -i "$BRIDGE"
chain "$V6" "$FWD" "-m comment --comment \"sandgate: no IPv6 between sandboxes\" -j DROP"
jump "$V6" FORWARD "$FWD" -i "$BRIDGE"

log "installed ($V4): the host drops everything from $BRIDGE; on $BRIDGE only" \
  "$PROXY_ADDR:$PROXY_PORT/tcp is reachable"
"$V4" -w -S "$IN"; "$V4" -w -S "$FWD"
