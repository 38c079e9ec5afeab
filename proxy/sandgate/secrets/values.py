"""A value read from Vault, checked before it may be injected (the broker's and the leases').

One check for every way a value arrives (static secrets in sandgate.secrets.vault, dynamic ones
in sandgate.secrets.leases), so the two cannot drift apart.
"""

from __future__ import annotations

from sandgate.errors import SecretError
from sandgate.text import breaks_header


def check_value(name: str, value: object) -> str:
    """Validate a value read from Vault before it may be injected. Never echoes the value."""
    if not isinstance(value, str):
        raise SecretError(name, f"secret '{name}' is unusable: its value is not a string "
                                f"(Vault returned a {type(value).__name__})")
    if not value:
        raise SecretError(name, f"secret '{name}' is unusable: its value is empty")
    if breaks_header(value):
        raise SecretError(name, f"secret '{name}' is unusable: refusing to inject a value with "
                                "control characters (CR, LF or NUL)")
    return value
