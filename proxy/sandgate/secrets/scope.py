"""Per-identity and per-sandbox secret paths: `{{ identity }}` and `{{ sandbox }}`.

A secret's path may name the caller: `secret/data/sandboxes/{{ sandbox }}/github` gives each
sandbox its own value. The variables are parsed once at load time (`parse_path`, which also
rejects anything else that looks like a template) and filled from the caller at request time
(`resolve`). What is filled in must be a plain name: a sandbox id with '/' or '..' would walk
to another path, so it is refused instead (sandbox_required).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sandgate.errors import SandboxRequired
from sandgate.policy.model import PATH_VARIABLES, SecretRef, path_variable

_VAR_RE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_.]*)\s*\}\}")
_TEMPLATE_LOOKING = re.compile(r"\{\{|\}\}|\{%|%\}|\$\{")
# What may be put into a path: Docker container names and token sandbox ids in practice.
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")


def parse_path(text: str) -> str:
    """`text` with its variables in the one stored spelling (`{{ sandbox }}`); ValueError with a
    readable message for an unknown variable or stray template text."""
    out: list[str] = []
    pos = 0
    for m in _VAR_RE.finditer(text):
        lit = text[pos:m.start()]
        _check_literal(lit, text)
        var = m.group(1)
        if var not in PATH_VARIABLES:
            raise ValueError(f"path {text!r} uses unknown variable {{{{ {var} }}}}; a path may "
                             "use only {{ identity }} and {{ sandbox }}")
        out += [lit, path_variable(var)]
        pos = m.end()
    lit = text[pos:]
    _check_literal(lit, text)
    out.append(lit)
    return "".join(out)


def _check_literal(lit: str, whole: str) -> None:
    m = _TEMPLATE_LOOKING.search(lit)
    if m:
        raise ValueError(f"path {whole!r} has template-looking text {m.group(0)!r} outside a "
                         "`{{ identity }}` or `{{ sandbox }}` variable")


def has_variables(text: str) -> bool:
    return any(path_variable(v) in text for v in PATH_VARIABLES)


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose value a cached secret is: both None for a secret shared by every caller."""

    identity: str | None = None
    sandbox: str | None = None

    def covers(self, other: Scope) -> bool:
        """Is a value of scope `other` one this scope's caller may hold? (shared values: yes)"""
        return (other.identity in (None, self.identity)
                and other.sandbox in (None, self.sandbox))


GLOBAL = Scope()


def scope_of(ref: SecretRef, identity: str | None, sandbox: str | None) -> Scope:
    """The scope a caller's value of `ref` belongs to (leases are always per sandbox)."""
    return Scope(identity if ref.per_identity or ref.per_sandbox else None,
                 sandbox if ref.per_sandbox else None)


def resolve(ref: SecretRef, identity: str | None, sandbox: str | None) -> str:
    """`ref`'s path for this caller (KV: inside the mount; dynamic: the engine path).

    Raises SandboxRequired when the path needs a sandbox id the caller does not have, or an id
    that cannot safely be put into a path."""
    raw = ref.dynamic.path if ref.dynamic is not None else ref.path
    if ref.per_sandbox:
        if sandbox is None:
            raise SandboxRequired(
                ref.name, f"secret '{ref.name}' is per sandbox, and this caller has no sandbox "
                "id", hint="issue the proxy token with a sandbox id (sandgate token issue "
                "--sandbox ID), or run the sandbox with the sandgate.sandbox label")
        if not SAFE_ID.fullmatch(sandbox) or ".." in sandbox:
            raise SandboxRequired(
                ref.name, f"secret '{ref.name}' is per sandbox, and this caller's sandbox id "
                "cannot be used in a secret path", hint="use a sandbox id of letters, digits, "
                "'.', '_', '@' and '-' (no '..')")
        raw = raw.replace(path_variable("sandbox"), sandbox)
    if ref.per_identity:
        if identity is None or not SAFE_ID.fullmatch(identity) or ".." in identity:
            raise SandboxRequired(ref.name, f"secret '{ref.name}' is per identity, and this "
                                  "caller's identity cannot be used in a secret path")
        raw = raw.replace(path_variable("identity"), identity)
    return raw
