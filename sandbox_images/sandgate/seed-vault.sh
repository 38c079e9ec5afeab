#!/bin/sh
# One-shot seeding of the demo Vault (the compose `vault-seed` service), with OpenBao's `bao` CLI:
#
#   1. wait until Vault answers unsealed ($VAULT_ADDR, root token $VAULT_TOKEN)
#   2. put the demo secrets: OBVIOUSLY FAKE values (override with SANDGATE_DEMO_ANTHROPIC_KEY /
#      SANDGATE_DEMO_OPENAI_KEY), at secret/llm/anthropic and secret/llm/openai, field api_key
#   3. enable AppRole, write the read-only policy `sandgate-read` (read secret/data/llm/*) and
#      the role `sandgate` (optionally bound to SANDGATE_BOUND_CIDRS, comma-separated)
#   4. write role_id and a fresh secret_id to $SANDGATE_APPROLE_DIR (mode 0600): a volume only
#      this service and the sandgate service mount
#
# Idempotent: running it again against the same Vault updates everything and issues a new
# secret_id. Never prints a secret, a secret_id or the root token.
set -eu

: "${VAULT_ADDR:?VAULT_ADDR must be set}"
: "${VAULT_TOKEN:?VAULT_TOKEN (a token allowed to configure Vault, e.g. the dev root token) must be set}"
BAO_ADDR=$VAULT_ADDR
BAO_TOKEN=$VAULT_TOKEN
export BAO_ADDR BAO_TOKEN
APPROLE_DIR=${SANDGATE_APPROLE_DIR:-/var/lib/sandgate/approle}
WAIT=${SANDGATE_VAULT_WAIT:-60}
ANTHROPIC=${SANDGATE_DEMO_ANTHROPIC_KEY:-demo-anthropic-key-not-real-0001}
OPENAI=${SANDGATE_DEMO_OPENAI_KEY:-demo-openai-key-not-real-0001}
BOUND_CIDRS=${SANDGATE_BOUND_CIDRS:-}

log() { echo "seed-vault: $*" >&2; }
die() { log "error: $*"; exit 1; }

# --- 1. wait ------------------------------------------------------------------------------------
waited=0
until bao status >/dev/null 2>&1; do
  [ "$waited" -lt "$WAIT" ] || die "Vault at $VAULT_ADDR not ready (unsealed) after ${WAIT} s"
  sleep 1
  waited=$((waited + 1))
done
log "Vault at $VAULT_ADDR is ready"

# --- 2. demo secrets (values on stdin, never on a command line) ---------------------------------
printf '%s' "$ANTHROPIC" | bao kv put -mount=secret llm/anthropic api_key=- >/dev/null
printf '%s' "$OPENAI" | bao kv put -mount=secret llm/openai api_key=- >/dev/null
log "put secret/llm/anthropic and secret/llm/openai (field api_key; demo values)"

# --- 3. AppRole -----------------------------------------------------------------------------------
if ! bao auth list -format=json | grep -q '"approle/"'; then
  bao auth enable approle >/dev/null
  log "enabled auth method approle"
fi
bao policy write sandgate-read - >/dev/null <<'POLICY'
# Sandgate reads the LLM API keys, nothing else, and cannot write.
path "secret/data/llm/*" {
  capabilities = ["read"]
}
POLICY
set -- token_policies=sandgate-read token_ttl=1h token_max_ttl=4h \
       secret_id_ttl=0 secret_id_num_uses=0
if [ -n "$BOUND_CIDRS" ]; then
  set -- "$@" "secret_id_bound_cidrs=$BOUND_CIDRS" "token_bound_cidrs=$BOUND_CIDRS"
fi
bao write auth/approle/role/sandgate "$@" >/dev/null
log "wrote policy sandgate-read and AppRole role sandgate${BOUND_CIDRS:+ (bound to $BOUND_CIDRS)}"

# --- 4. credentials for the sandgate service --------------------------------------------------
umask 077
mkdir -p "$APPROLE_DIR"
bao read -field=role_id auth/approle/role/sandgate/role-id > "$APPROLE_DIR/.role_id.tmp"
bao write -f -field=secret_id auth/approle/role/sandgate/secret-id > "$APPROLE_DIR/.secret_id.tmp"
[ -s "$APPROLE_DIR/.role_id.tmp" ] && [ -s "$APPROLE_DIR/.secret_id.tmp" ] \
  || die "Vault returned no role_id or secret_id"
mv -f "$APPROLE_DIR/.role_id.tmp" "$APPROLE_DIR/role_id"
mv -f "$APPROLE_DIR/.secret_id.tmp" "$APPROLE_DIR/secret_id"
log "wrote role_id and secret_id to $APPROLE_DIR"
