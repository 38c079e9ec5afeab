"""Secrets from Vault / OpenBao and token endpoints: fetched, cached, leased, scoped per identity,
and put in the forms that injection writes and scrubbing looks for."""
