"""`sandgate lint --mcp-tools [HOST=]FILE`: tool globs of `mcp:` rules that match nothing the
MCP server lists.

FILE is a recorded answer to tools/list: the JSON-RPC response, its `result`, or a list of
tools (objects with `name`, or names); several pages may be given as several flags. With
HOST= it applies to the rules naming that host, without to every rule with `mcp:`. A glob in
`tools` that matches no listed tool allows nothing today (a typo, or a tool renamed); one in
`deny_tools` refuses nothing (the tool it meant to stop may be there under another name). A
glob in `tools` that matches several listed tools, some of them not marked read-only by the
server (`annotations.readOnlyHint`), is wider than it may look (`create_*` matching
create_repository and create_webhook as well as create_issue): lint names what it matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandgate.policy.model import Policy, glob_matches
from sandgate.rpc.jsonrpc import CallError, loads

Listings = dict[str | None, dict[str, bool]]


def read_listings(specs: Sequence[str] | None) -> Listings:
    """host (None: every host) -> the tool names listed -> whether the server marks the tool
    read-only (annotations.readOnlyHint). Raises ValueError with the file."""
    out: Listings = {}
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
        out.setdefault(host.lower() or None, {}).update(names)
    return out


def _names(doc: Any) -> dict[str, bool] | None:
    if isinstance(doc, dict) and isinstance(doc.get("result"), dict):
        doc = doc["result"]
    if isinstance(doc, dict):
        doc = doc.get("tools")
    if not isinstance(doc, list):
        return None
    out: dict[str, bool] = {}
    for t in doc:
        name = t.get("name") if isinstance(t, dict) else t
        if not isinstance(name, str):
            return None
        notes = t.get("annotations") if isinstance(t, dict) else None
        out[name] = isinstance(notes, dict) and notes.get("readOnlyHint") is True
    return out


def tool_findings(policy: Policy, listings: Listings, finding: Any) -> list[Any]:
    """finding(code, file, loc, message, fix) builds a lint Finding."""
    out: list[Any] = []
    for ident in policy.identities.values():
        for k, rule in enumerate(ident.rules):
            f = rule.call
            if f is None or f.protocol != "mcp":
                continue
            tools: dict[str, bool] = dict(listings.get(None, {}))
            known = listings.get(None) is not None
            for h, names in listings.items():
                if h is not None and rule.matches_host(h):
                    tools.update(names)
                    known = True
            listed = set(tools)
            if not known:
                continue
            loc = rule.where or ("identities", ident.name, "rules", k)
            for key, globs in (("tools", f.tools or ()), ("deny_tools", f.deny_tools)):
                for j, g in enumerate(globs):
                    hits = sorted(n for n in listed if glob_matches(g, n))
                    writes = [n for n in hits if not tools[n]]
                    if key == "tools" and len(hits) > 1 and writes and g != "*":
                        out.append(finding(
                            "mcp-tool-glob", rule.source.file, (*loc, "mcp", key, j),
                            f"tools entry {g!r} of rule '{rule.name}' matches {len(hits)} "
                            f"tools the server lists: {', '.join(hits)} ("
                            f"{', '.join(writes)} not marked read-only)",
                            f"list the tools meant by name (e.g. tools: [{hits[0]}]); if "
                            f"every one of them is meant, say so: `lint: {{ignore: "
                            f"[mcp-tool-glob], why: ...}}`"))
                    if hits:
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

