#!/bin/sh
# Entrypoint of the `sandgate` compose service: `sandgate-entrypoint [sandgate run options]`.
#
#   1. AppRole credentials: unless VAULT_TOKEN or VAULT_ROLE_ID is already set, read role_id and
#      secret_id from $SANDGATE_APPROLE_DIR (written by the vault-seed service; a volume that
#      only vault-seed and sandgate mount) into VAULT_ROLE_ID / VAULT_SECRET_ID.
#   2. The CA: create it in $SANDGATE_CONFDIR if needed and publish ONLY its certificate to
#      $SANDGATE_CA_PUBLIC_DIR (mounted read-only by the sandboxes):
#        sandgate-ca.pem   the Sandgate CA certificate
#        ca-bundle.pem     the system roots + the Sandgate CA (for SSL_CERT_FILE and friends)
#        wgetrc            `ca_certificate = <the bundle>` (wget reads no CA variable; WGETRC)
#   3. exec `sandgate run "$@"`.
set -eu

APPROLE_DIR=${SANDGATE_APPROLE_DIR:-/var/lib/sandgate/approle}
CA_PUBLIC_DIR=${SANDGATE_CA_PUBLIC_DIR:-/var/lib/sandgate/ca-public}
CONFDIR=${SANDGATE_CONFDIR:-/var/lib/sandgate/conf}
WAIT=${SANDGATE_APPROLE_WAIT:-60}
SYSTEM_BUNDLE=/etc/ssl/certs/ca-certificates.crt

log() { echo "sandgate-entrypoint: $*" >&2; }
die() { log "error: $*"; exit 1; }

# --- 1. AppRole ---------------------------------------------------------------------------------
if [ -z "${VAULT_TOKEN:-}" ] && [ -z "${VAULT_ROLE_ID:-}" ]; then
  waited=0
  until [ -s "$APPROLE_DIR/role_id" ] && [ -s "$APPROLE_DIR/secret_id" ]; do
    [ "$waited" -lt "$WAIT" ] || die "no $APPROLE_DIR/role_id + secret_id after ${WAIT} s (did vault-seed run?)"
    sleep 1
    waited=$((waited + 1))
  done
  VAULT_ROLE_ID=$(cat "$APPROLE_DIR/role_id")
  VAULT_SECRET_ID=$(cat "$APPROLE_DIR/secret_id")
  export VAULT_ROLE_ID VAULT_SECRET_ID
  log "AppRole credentials read from $APPROLE_DIR"
fi
[ -n "${VAULT_ADDR:-}" ] || log "warning: VAULT_ADDR is not set: sandgate starts an embedded dev Vault"

# --- 2. CA ----------------------------------------------------------------------------------------
mkdir -p "$CA_PUBLIC_DIR"
tmp=$(mktemp "$CA_PUBLIC_DIR/.ca.XXXXXX")
sandgate ca --confdir "$CONFDIR" > "$tmp"
grep -q -- "-----BEGIN CERTIFICATE-----" "$tmp" || { rm -f "$tmp"; die "sandgate ca printed no certificate"; }
if grep -q "PRIVATE KEY" "$tmp"; then rm -f "$tmp"; die "sandgate ca printed a private key: not publishing it"; fi
chmod 0644 "$tmp"
mv -f "$tmp" "$CA_PUBLIC_DIR/sandgate-ca.pem"
tmp=$(mktemp "$CA_PUBLIC_DIR/.bundle.XXXXXX")
if [ -s "$SYSTEM_BUNDLE" ]; then cat "$SYSTEM_BUNDLE" > "$tmp"; fi
cat "$CA_PUBLIC_DIR/sandgate-ca.pem" >> "$tmp"
chmod 0644 "$tmp"
mv -f "$tmp" "$CA_PUBLIC_DIR/ca-bundle.pem"
tmp=$(mktemp "$CA_PUBLIC_DIR/.wgetrc.XXXXXX")
# The path the sandboxes mount the directory at (docker-compose.yml), not ours.
echo "ca_certificate = ${SANDGATE_CA_SANDBOX_DIR:-/etc/sandgate/ca}/ca-bundle.pem" > "$tmp"
chmod 0644 "$tmp"
mv -f "$tmp" "$CA_PUBLIC_DIR/wgetrc"
log "published the CA certificate to $CA_PUBLIC_DIR (sandgate-ca.pem, ca-bundle.pem, wgetrc)"

# --- 3. run -------------------------------------------------------------------------------------
exec sandgate run --confdir "$CONFDIR" "$@"
