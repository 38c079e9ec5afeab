"""`sandgate report DIR`: per identity, what it can reach and with which secrets.

One entry per rule, in decision order, with what the compiled rule says (schemes, hosts, ports,
methods, paths, query values, the secrets it injects or substitutes and where they are read,
passthrough, private ranges) and what the policy around it does to it: the deny rules that cut
into it and the earlier allow rules that take some of its requests (found with the exact reach
search, sandgate.review.reach, each with an example request). Rendered as markdown or as one
self-contained HTML page (inline CSS and JS, a filter box, every entry linked to file:line).
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sandgate.policy.call_rules import describe_filter
from sandgate.policy.model import Budget, Identity, LlmRule, Policy, Rule
from sandgate.policy.overlap import signed_covers
from sandgate.review.callproofs import common_call
from sandgate.review.grants import describe_gate
from sandgate.review.lint_semantic import decides_while_matching
from sandgate.review.reach import decider, find_request
from sandgate.review.reach_diff import md_cell
from sandgate.secrets.describe import gh_app_form, sign_text


@dataclass(slots=True)
class Entry:
    identity: str
    rule: Rule
    secrets: list[str]  # "name (mount/path#field)"
    notes: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        r = self.rule
        return ("deny" if r.action == "deny" else "tunnel" if r.passthrough else r.verb)

    def cells(self) -> dict[str, str]:
        r = self.rule
        hosts = "any public host" if r.public else ", ".join(p.text for p in r.hosts)
        return {
            "kind": self.kind,
            "rule": r.name,
            "reach": f"{'/'.join(sorted(r.schemes))}://{hosts} : "
                     f"{', '.join(map(str, sorted(r.ports)))}",
            "methods": ", ".join(sorted(r.methods)) if r.methods is not None else "any",
            "paths": ", ".join(p.text for p in r.paths) if r.paths is not None else "any",
            "query": query_text(r),
            "secrets": ", ".join(self.secrets) or "none",
            "private": ", ".join(map(str, r.private_cidrs)) or "",
            "notes": " ".join(self.notes),
            "source": str(r.source),
        }


def query_text(r: Rule) -> str:
    """Every `query:` constraint of a rule, in one cell: required values, optional ones (the
    parameter may be missing) and parameters that must be absent; "any" without constraints."""
    parts = [f"{n}={'|'.join(sorted(v))}" for n, v in r.query]
    parts += [f"{n}={'|'.join(sorted(v))} (optional)" for n, v in r.query_optional]
    parts += [f"{n} absent" for n in sorted(r.query_absent)]
    return "; ".join(parts) or "any"


@dataclass(slots=True)
class IdentityReport:
    name: str
    mode: str
    narrower_than: str | None
    source: str
    entries: list[Entry]


@dataclass(slots=True)
class Report:
    title: str
    identities: list[IdentityReport]
    # secret -> (where it is read, [(identity, rule, file:line)])
    secrets: dict[str, tuple[str, list[tuple[str, str, str]]]] = field(default_factory=dict)


def _secret_text(policy: Policy, name: str, r: Rule) -> str:
    ref = policy.secrets.get(name)
    how = "substituted" if name in r.substitute and not (
        r.inject and name in r.inject.secrets) else "injected"
    if how == "substituted" and r.substitute_body:
        how = "substituted in headers and body"
    if ref is None:
        return name
    where = ref.location + (f"#{ref.field}" if ref.dynamic is None and ref.oauth2 is None
                            else "")
    if ref.oauth2 is not None:
        scope = (f", scopes {ref.oauth2.scope}" if ref.oauth2.scope
                 else ", the client's default scopes")
        where = (f"oauth2 {ref.oauth2.grant} from {ref.oauth2.token_url}{scope}, client record "
                 f"{where}")
    if ref.github_app is not None:
        how = f"{gh_app_form(r.github_scope)}, installation {ref.github_app.installation_id}"
    if ref.aws is not None and r.inject is not None and r.inject.sign is not None:
        how = sign_text(policy, r.inject.sign, None)
    only = f", only to {', '.join(p.text for p in ref.hosts)}" if ref.hosts else ""
    return f"{name} ({how}; {where}{only})"


def _notes(ident: Identity, k: int, budgets: Mapping[str, Budget] | None = None) -> list[str]:
    rules = list(ident.rules)
    r = rules[k]
    out: list[str] = []
    if r.meta is not None and r.meta.lint_ignore:  # `lint: {ignore, why}`: for reviewers
        out.append(f"lint warnings {', '.join(r.meta.lint_ignore)} suppressed: "
                   f"{r.meta.lint_why}")
    if r.action == "deny" or r.passthrough:
        return out
    if r.ask is not None:
        out.append(describe_gate(r.ask))
    if r.call is not None:
        out.append(f"each JSON-RPC call judged ({describe_filter(r.call)})")
    if r.ask is not None and r.call is not None and r.call.protocol == "mcp":
        out.append("(MCP housekeeping: initialize, ping, the list calls... "
                   + ("held too, ask_housekeeping)" if r.call.ask_housekeeping
                      else "not held, only the calls wait for approval)"))
    if r.llm is not None:
        out.append(llm_text(r.llm, (budgets or {}).get(r.llm.budget or ""),
                            injects=r.inject is not None))
    if r.inject is not None and r.inject.sign is not None:
        ops = ", ".join(r.operations) if r.operations is not None else "any"
        sources = (", ".join(p.text for p in r.copy_sources) if r.copy_sources is not None
                   else "none")
        out.append(f"signs operations: {ops}; copy sources: {sources}")
    if r.dns_types:
        out.append(f"policy DNS also answers {', '.join(sorted(r.dns_types))} for its hosts")
    for d in rules:
        if d.action == "deny":
            w = find_request([r, d], lambda v: v[0] and v[1], required=(0, 1))
            if w is not None:
                out.append(f"except deny rule '{d.name}' (e.g. {w})")
    for i in range(k):
        a = rules[i]
        if a.action != "allow" or a.passthrough:
            continue
        call = common_call(a, r)
        if call is None:
            continue  # mcp:/jsonrpc: with no call in common: each decides its own
        if not signed_covers(a, r):
            continue  # `a` signs other operations or sources: each decides its own
        w = find_request(rules, decides_while_matching(rules, i, k), required=(i, k))
        if w is not None:
            out.append(f"some requests go to earlier rule '{a.name}' (e.g. {w}{call})")
    # an earlier rule with mcp:/jsonrpc: passes on the calls it does not allow
    # (or a signing rule passes on what it does not sign)
    passed_on = any(a.call is not None or not signed_covers(a, r) for a in rules[:k]
                    if a.action == "allow")
    if not passed_on and not find_request(rules, lambda v: decider(rules, v) == k,
                                          required=(k,)):
        out.append("never decides a request")
    if r.public:
        out.append("only hosts that resolve to public addresses")
    if ident.mode == "report":
        out.append("identity in report mode: refusals are forwarded")
    return out


def llm_text(f: LlmRule, budget: Budget | None, injects: bool = True) -> str:
    """A rule's `llm:` in the report's words (sandgate.llm.spend): what it lets through, what it
    holds the calls to."""
    words = [f"LLM calls judged ({f.api or 'API by host'}): models "
             + (", ".join(f.models) if f.models is not None else "any")]
    if f.max_tokens is not None:
        words.append(f"max_tokens {f.max_tokens} ("
                     + ("over it refused" if f.on_max_tokens == "refuse" else "lowered to it")
                     + ")")
    if f.budget is not None:
        limits = "" if budget is None else " (" + ", ".join(
            f"{k} {v}" for k, v in (("input_tokens", budget.input_tokens),
                                    ("output_tokens", budget.output_tokens),
                                    ("cost_usd", budget.cost_usd)) if v is not None
        ) + f" per {budget.per}s per {budget.scope})"
        words.append(f"budget {f.budget}{limits}")
    if injects:  # a sandbox's own key (stages/s37_llm): only on a rule that injects one
        words.append("a sandbox's own key " + ("replaced" if f.own_credentials == "replace"
                                               else "refused"))
    return "; ".join(words) + "."


def build_report(policy: Policy, title: str) -> Report:
    idents = []
    for ident in policy.identities.values():
        entries = [Entry(ident.name, r, [_secret_text(policy, s, r) for s in sorted(r.secrets)],
                         _notes(ident, k, policy.budgets)) for k, r in enumerate(ident.rules)]
        idents.append(IdentityReport(ident.name, ident.mode, ident.narrower_than,
                                     str(ident.source), entries))
    secrets: dict[str, tuple[str, list[tuple[str, str, str]]]] = {}
    for name, ref in policy.secrets.items():
        users = [(i.name, r.name, str(r.source)) for i in policy.identities.values()
                 for r in i.rules if r.action == "allow" and name in r.secrets]
        users += [("webhook", h.name, str(h.source)) for h in policy.webhooks.values()
                  if h.secret == name]  # the HMAC key of approval announcements
        only = f"; only to {', '.join(p.text for p in ref.hosts)}" if ref.hosts else ""
        secrets[name] = (ref.location + only, users)
    return Report(title, idents, secrets)


_COLUMNS = ("kind", "rule", "reach", "methods", "paths", "query", "secrets", "notes", "source")


def format_markdown(rep: Report) -> str:
    out = [f"# Sandgate reach report: {rep.title}", ""]
    for ir in rep.identities:
        extra = (f", declared narrower than `{ir.narrower_than}` (`sandgate check` proves it)"
                 if ir.narrower_than else "")
        out += [f"## `{ir.name}`", "", f"mode {ir.mode}{extra}; defined at {ir.source}. "
                "Everything not allowed below is refused (deny by default).", ""]
        if not ir.entries:
            out += ["No rules: reaches nothing.", ""]
            continue
        out += ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
        for e in ir.entries:
            c = e.cells()
            out.append("| " + " | ".join(md_cell(c[k]) for k in _COLUMNS) + " |")
        out.append("")
    if rep.secrets:
        out += ["## Secrets", "", "| secret | read from | sent by (identity: rule) |",
                "|---|---|---|"]
        for name, (where, users) in rep.secrets.items():
            by = "; ".join(f"{i}: {r} ({src})" for i, r, src in users) or "no rule"
            out.append(f"| {md_cell(name)} | {md_cell(where)} | {md_cell(by)} |")
        out.append("")
    return "\n".join(out)


def format_json(rep: Report) -> str:
    return json.dumps({"title": rep.title, "secrets": {
        n: {"location": w, "rules": [{"identity": i, "rule": r, "source": src}
                                     for i, r, src in u]} for n, (w, u) in rep.secrets.items()},
        "identities": [
        {"name": ir.name, "mode": ir.mode, "narrower_than": ir.narrower_than,
         "source": ir.source, "rules": [e.cells() for e in ir.entries]}
        for ir in rep.identities]}, indent=2) + "\n"


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;width:100%}th,td{border:1px solid #ccc;padding:.3em .5em;
vertical-align:top;text-align:left}th{background:#f3f3f3}
tr.deny td:first-child{color:#a00;font-weight:bold}tr.tunnel td:first-child{color:#a60}
tr.allow td:first-child{color:#070}code{font-size:.95em}
#filter{width:100%;font-size:1.1em;padding:.4em;margin:.5em 0 1em}
.meta{color:#555}
"""

_JS = """
const box=document.getElementById('filter');
box.addEventListener('input',()=>{const q=box.value.toLowerCase();
document.querySelectorAll('section').forEach(s=>{let n=0;
s.querySelectorAll('tbody tr').forEach(tr=>{const hit=!q||tr.textContent.toLowerCase()
.includes(q)||s.dataset.identity.toLowerCase().includes(q);tr.hidden=!hit;if(hit)n++;});
s.hidden=n===0&&q!=='';});});
"""


def _link(source: str, base: str | None) -> str:
    file, _, line = source.rpartition(":")
    href = (base.rstrip("/") + "/" + Path(file).name if base else file) + f"#L{line}"
    return f'<a href="{html.escape(href)}">{html.escape(source)}</a>'


def format_html(rep: Report, link_base: str | None = None) -> str:
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>Sandgate reach report: {e(rep.title)}</title>",
             f"<style>{_CSS}</style></head><body>",
             f"<h1>Sandgate reach report: {e(rep.title)}</h1>",
             "<input id='filter' placeholder='filter: identity, host, path, secret, rule...' "
             "autofocus>"]
    for ir in rep.identities:
        extra = (f", declared narrower than <code>{e(ir.narrower_than)}</code> "
                 "(<code>sandgate check</code> proves it)" if ir.narrower_than else "")
        parts += [f"<section data-identity='{e(ir.name)}'><h2>{e(ir.name)}</h2>",
                  f"<p class='meta'>mode {e(ir.mode)}{extra}; defined at "
                  f"{_link(ir.source, link_base)}. Everything not allowed below is refused.</p>"]
        if not ir.entries:
            parts.append("<p>No rules: reaches nothing.</p></section>")
            continue
        parts.append("<table><thead><tr>" + "".join(f"<th>{c}</th>" for c in _COLUMNS)
                     + "</tr></thead><tbody>")
        for en in ir.entries:
            c = en.cells()
            tds = "".join(f"<td>{_link(c[k], link_base) if k == 'source' else e(c[k])}</td>"
                          for k in _COLUMNS)
            parts.append(f"<tr class='{en.kind}'>{tds}</tr>")
        parts.append("</tbody></table></section>")
    if rep.secrets:
        parts.append("<section data-identity='secrets'><h2>Secrets</h2><table><thead><tr>"
                     "<th>secret</th><th>read from</th><th>sent by</th></tr></thead><tbody>")
        for name, (where, users) in rep.secrets.items():
            by = "<br>".join(f"{e(i)}: {e(r)} ({_link(src, link_base)})" for i, r, src in users)
            parts.append(f"<tr><td>{e(name)}</td><td>{e(where)}</td><td>{by or 'no rule'}"
                         "</td></tr>")
        parts.append("</tbody></table></section>")
    parts.append(f"<script>{_JS}</script></body></html>\n")
    return "\n".join(parts)


__all__ = ["Report", "build_report", "format_html", "format_json", "format_markdown"]
