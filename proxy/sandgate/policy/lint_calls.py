"""`sandgate lint --mcp-tools [HOST=]FILE`: tool globs of `mcp:` rules that match nothing the
MCP server lists.

FILE is a recorded answer to tools/list: the JSON-RPC response, its `result`, or a list of
tools (objects with `name`, or names); several pages may be given as several flags. With
HOST= it applies to the rules naming that host, without to every rule with `mcp:`. A glob in
`tools` that matches no listed tool allows nothing today (a typo, or a tool renamed); one in
`deny_tools` refuses nothing (the tool it meant to stop may be there under another name).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandgate.jsonrpc import CallError, loads
from sandgate.policy.model import Policy, glob_matches


def read_listings(specs: Sequence[str] | None) -> dict[str | None, set[str]]:
    """host (None: every host) -> the tool names listed. Raises ValueError with the file."""
    out: dict[str | None, set[str]] = {}
    for spec in specs or ():
        host, sep, file = spec.partition("=")
        if not sep:
            host, file = "", spec
        try:
            doc = loads(Path(file).read_bytes())
        except (OSError, CallError) as e:
            raise ValueError(f"--mcp-tools {file}: {e}") from None
        names = _names(doc)
        if names is None:
            raise ValueError(f"--mcp-tools {file}: not a tools/list answer (a JSON-RPC "
                             "response, its result, or a list of tools)")
        out.setdefault(host.lower() or None, set()).update(names)
    return out


def _names(doc: Any) -> set[str] | None:
    if isinstance(doc, dict) and isinstance(doc.get("result"), dict):
        doc = doc["result"]
    if isinstance(doc, dict):
        doc = doc.get("tools")
    if not isinstance(doc, list):
        return None
    names = {t.get("name") if isinstance(t, dict) else t for t in doc}
    return {n for n in names if isinstance(n, str)} if all(
        isinstance(n, str) for n in names) else None


def tool_findings(policy: Policy, listings: dict[str | None, set[str]],
                  finding: Any) -> list[Any]:
    """finding(code, file, loc, message, fix) builds a lint Finding."""
    out: list[Any] = []
    for ident in policy.identities.values():
        for k, rule in enumerate(ident.rules):
            f = rule.call
            if f is None or f.protocol != "mcp":
                continue
            listed: set[str] = set(listings.get(None, set()))
            known = listings.get(None) is not None
            for h, names in listings.items():
                if h is not None and rule.matches_host(h):
                    listed |= names
                    known = True
            if not known:
                continue
            loc = rule.where or ("identities", ident.name, "rules", k)
            for key, globs in (("tools", f.tools or ()), ("deny_tools", f.deny_tools)):
                for j, g in enumerate(globs):
                    if any(glob_matches(g, n) for n in listed):
                        continue
                    close = sorted(listed)[:8]
                    what = "allows nothing" if key == "tools" else "refuses nothing"
                    out.append(finding(
                        "mcp-tool-unlisted" if key == "tools" else "mcp-deny-unmatched",

                        rule.source.file, (*loc, "mcp", key, j),
                        f"{key} entry {g!r} of rule '{rule.name}' matches no tool the server "
                        f"lists, so it {what}",
                        f"spell it as the server does ({', '.join(close) or 'no tools'}"
                        f"{', ...' if len(listed) > 8 else ''}), or remove it"))
    return out

