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
#
# Optional (docs/transparent.md, docs/dns.md):
#   SANDGATE_DNS_ADDR           the policy DNS (`sandgate run --dns`): UDP/TCP 53 to it pass
#   SANDGATE_TRANSPARENT_PORT   transparent capture: the sandboxes' TCP to SANDGATE_CAPTURE_PORTS
#                               (80,443, the default, or one of them) leaving the subnet is DNATed to
#                               SANDGATE_PROXY_ADDR:this port (`sandgate run --transparent`);
#                               every other packet leaving the subnet is dropped and counted, one
#                               rule per kind (quic, dns, tcp, udp, other: `iptables -t mangle
#                               -L SG-CAP-<bridge> -v`). Needs br_netfilter for the replies'
#                               reverse NAT (as for the rest of this script).
set -euo pipefail

BRIDGE=${SANDGATE_SBX_BRIDGE:?SANDGATE_SBX_BRIDGE is required}
SUBNET=${SANDGATE_SBX_SUBNET:?SANDGATE_SBX_SUBNET is required}
PROXY_ADDR=${SANDGATE_PROXY_ADDR:?SANDGATE_PROXY_ADDR is required}
PROXY_PORT=${SANDGATE_PROXY_PORT:?SANDGATE_PROXY_PORT is required}
TPORT=${SANDGATE_TRANSPARENT_PORT:-}
CAPTURE_PORTS=${SANDGATE_CAPTURE_PORTS:-80,443}
DNS_ADDR=${SANDGATE_DNS_ADDR:-}
IN=SG-IN-$BRIDGE
FWD=SG-FWD-$BRIDGE
NAT=SG-NAT-$BRIDGE  # transparent capture: DNAT to the transparent listener (table nat)
CAP=SG-CAP-$BRIDGE  # transparent capture: what is not captured is dropped and counted (mangle)
log() { echo "sandbox-firewall: $*"; }
die() { echo "sandbox-firewall: error: $*" >&2; exit 1; }

[[ ${#FWD} -le 28 ]] || die "bridge name too long for a chain name: $BRIDGE"
[[ $PROXY_PORT =~ ^[0-9]+(,[0-9]+)*$ ]] || die "SANDGATE_PROXY_PORT is not a port (or ports, comma-separated): $PROXY_PORT"
# One rule per port (the proxy, and pattern 1's role listeners: docs/pattern1.md).
PORT_RULES=()
[[ -z $TPORT || $TPORT =~ ^[0-9]+$ ]] || die "SANDGATE_TRANSPARENT_PORT is not a port: $TPORT"
# only 80 and 443: the DNAT to Sandgate's container hides the original port from it, so it
# judges TLS as port 443 and plain HTTP as 80 (docs/transparent.md)
[[ $CAPTURE_PORTS =~ ^(80|443)(,(80|443))?$ ]] || die "SANDGATE_CAPTURE_PORTS: 80 and/or 443 only, got: $CAPTURE_PORTS"
[[ -z $DNS_ADDR || $DNS_ADDR =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "SANDGATE_DNS_ADDR is not an IPv4 address: $DNS_ADDR"
for port in ${PROXY_PORT//,/ } $TPORT; do
  PORT_RULES+=("-s $SUBNET -d $PROXY_ADDR/32 -o $BRIDGE -p tcp -m tcp --dport $port -m conntrack --ctstate NEW -j RETURN")
done
if [[ -n $DNS_ADDR ]]; then  # the sandboxes' one resolver
  for proto in udp tcp; do
    PORT_RULES+=("-s $SUBNET -d $DNS_ADDR/32 -o $BRIDGE -p $proto -m $proto --dport 53 -j RETURN")
  done
fi

# The backend Docker uses (its DOCKER-USER chain is there): nft on current Debian, or legacy.
V4= V6=
for b in nft legacy; do
  if "iptables-$b" -w -n -L DOCKER-USER >/dev/null 2>&1; then V4=iptables-$b V6=ip6tables-$b; break; fi
done
[[ -n $V4 ]] || die "Docker's DOCKER-USER chain not found (iptables-nft, iptables-legacy): is this
the Docker host's network namespace (network_mode: host) and Docker's iptables integration on?"

# chain <tool> <name> <rule>...: replace the chain's rules in one transaction (no open moment).
# TABLE=nat|mangle chain ...: the same in another table.
chain() {
  local tool=$1 name=$2; shift 2
  {
    echo "*${TABLE:-filter}"
    echo ":$name - [0:0]"
    local r
    for r in "$@"; do echo "-A $name $r"; done
    echo "COMMIT"
  } | "$tool-restore" -w --noflush
}
# jump <tool> <from> <name> <match...>: insert `-j name` at the top of <from> once.
jump() {
  local tool=$1 from=$2 name=$3; shift 3
  "$tool" -w ${TABLE:+-t "$TABLE"} -C "$from" "$@" -j "$name" 2>/dev/null \
    || "$tool" -w ${TABLE:+-t "$TABLE"} -I "$from" 1 "$@" -j "$name"
}
unjump() {
  local tool=$1 from=$2 name=$3; shift 3
  while "$tool" -w ${TABLE:+-t "$TABLE"} -D "$from" "$@" -j "$name" 2>/dev/null; do :; done
}

if [[ ${SANDGATE_FIREWALL_REMOVE:-0} == 1 ]]; then
  unjump "$V4" INPUT "$IN" -i "$BRIDGE"; unjump "$V6" INPUT "$IN" -i "$BRIDGE"
  unjump "$V4" DOCKER-USER "$FWD" -i "$BRIDGE"; unjump "$V6" FORWARD "$FWD" -i "$BRIDGE"
  TABLE=nat unjump "$V4" PREROUTING "$NAT" -i "$BRIDGE"; TABLE=mangle unjump "$V4" PREROUTING "$CAP" -i "$BRIDGE"
  for t in nat mangle; do
    for c in "$NAT" "$CAP"; do "$V4" -w -t $t -F "$c" 2>/dev/null || true; "$V4" -w -t $t -X "$c" 2>/dev/null || true; done
  done
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

# Transparent capture: TCP to the captured ports leaving the subnet goes to the transparent
# listener; everything else leaving it is dropped here, counted per kind (before Docker's own
# isolation drops it uncounted).
if [[ -n $TPORT ]]; then
  TABLE=mangle chain "$V4" "$CAP" \
    "-d $SUBNET -j RETURN" \
    "-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN" \
    "-p tcp -m multiport --dports $CAPTURE_PORTS -j RETURN" \
    "-p udp -m udp --dport 443 -m comment --comment dropped_quic -j DROP" \
    "-p udp -m udp --dport 53 -m comment --comment dropped_dns -j DROP" \
    "-p tcp -m tcp --dport 53 -m comment --comment dropped_dns -j DROP" \
    "-p tcp -m comment --comment dropped_tcp -j DROP" \
    "-p udp -m comment --comment dropped_udp -j DROP" \
    "-m comment --comment dropped_other -j DROP"
  TABLE=mangle jump "$V4" PREROUTING "$CAP" -i "$BRIDGE"
  TABLE=nat chain "$V4" "$NAT" \
    "-d $SUBNET -j RETURN" \
    "-p tcp -m multiport --dports $CAPTURE_PORTS -m comment --comment captured -j DNAT --to-destination $PROXY_ADDR:$TPORT"
  TABLE=nat jump "$V4" PREROUTING "$NAT" -i "$BRIDGE"
else
  TABLE=nat unjump "$V4" PREROUTING "$NAT" -i "$BRIDGE"; TABLE=mangle unjump "$V4" PREROUTING "$CAP" -i "$BRIDGE"
fi

log "installed ($V4): the host drops everything from $BRIDGE; on $BRIDGE only" \
  "$PROXY_ADDR:$PROXY_PORT${TPORT:+,$TPORT}/tcp${DNS_ADDR:+ and $DNS_ADDR:53} is reachable" \
  "${TPORT:+(transparent capture of tcp $CAPTURE_PORTS to $PROXY_ADDR:$TPORT)}"
"$V4" -w -S "$IN"; "$V4" -w -S "$FWD"
if [[ -n $TPORT ]]; then "$V4" -w -t nat -S "$NAT"; "$V4" -w -t mangle -S "$CAP"; fi
