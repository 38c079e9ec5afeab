"""Compiled, internal policy types.

These are what the proxy and every tool work with; they are built once at load time from the
file-format models in sandgate.policy.schema and never change afterwards. Nothing here parses.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date
from typing import Literal

from sandgate.policy.paths import PathPattern
from sandgate.rpc.jsonrpc import Call

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Source:
    """Where a thing was defined, for error messages and audit: file and 1-based line."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True, slots=True)
class DynamicRef:
    """A secret minted by a Vault/OpenBao engine that answers with a lease (database/creds/...)."""

    path: str  # the full API path to read, e.g. "database/creds/readonly" (may hold {{ sandbox }})
    field: str  # the key of the credential in the response's data, e.g. "password"
    username_field: str | None = None  # the key of its user name: `{{ secrets.NAME.username }}`


# The variables a secret's path may use: `{{ identity }}` and `{{ sandbox }}`, resolved from the
# caller (token or Docker label) at request time. Stored in this one spelling.
PATH_VARIABLES = ("identity", "sandbox")


def path_variable(name: str) -> str:
    return "{{ " + name + " }}"


@dataclass(frozen=True, slots=True)
class OAuth2Ref:
    """`oauth2:` of a secret: the value is an access token from `token_url` (secrets/oauth2.py);
    the secret's KV v2 location holds client_id, client_secret (and refresh_token)."""

    token_url: str
    grant: Literal["client_credentials", "refresh_token"]
    scope: str | None = None
    client_auth: Literal["basic", "post"] = "basic"
    timeout: float = 10.0


@dataclass(frozen=True, slots=True)
class AwsRef:
    """`aws:` of a secret: SigV4 signing credentials (stages/s55_sign.py). A scope part left
    None comes from the rule or the request's host (secrets/aws_scope.py)."""

    region: str | None = None
    service: str | None = None


@dataclass(frozen=True, slots=True)
class SignRef:
    """A rule's `inject: {sign: ...}`: the `aws:` secret and the scope parts the rule names
    (they win over the secret's and the host's)."""

    secret: str
    service: str | None = None
    region: str | None = None


@dataclass(frozen=True, slots=True)
class GitHubAppRef:
    """`github_app:` of a secret: installation tokens minted with the private key stored at the
    secret's location (secrets/github_app.py)."""

    app_id: int
    installation_id: int
    api_url: str = "https://api.github.com"
    timeout: float = 10.0


@dataclass(frozen=True, slots=True)
class GitHubScope:
    """`github_app:` of a rule: the repositories and permissions its tokens are minted with
    (None: the installation's)."""

    repositories: tuple[str, ...] | None = None  # names, sorted
    permissions: tuple[tuple[str, str], ...] | None = None  # (name, level), sorted

    def describe(self) -> str:
        parts = [f"repo={r}" for r in self.repositories or ()]
        parts += [f"{k}={v}" for k, v in self.permissions or ()]
        return ", ".join(parts) or "the installation's repositories and permissions"


@dataclass(frozen=True, slots=True)
class SecretBudget:
    """`budget:` of a secret: at most `calls` injections per window of `per` seconds."""

    calls: int
    per: float


@dataclass(frozen=True, slots=True)
class IdentityLimits:
    """`limits:` of an identity; None: the proxy's flag applies."""

    rps: float | None = None  # requests a second (token bucket)
    burst: int | None = None  # bucket size; default rps rounded up
    max_connections: int | None = None  # open client connections at once


@dataclass(frozen=True, slots=True)
class SecretRef:
    name: str
    mount: str  # KV mount point, e.g. "secret" ("" for a dynamic secret)
    path: str  # path inside the mount, e.g. "llm/anthropic"; may use {{ identity }}/{{ sandbox }}
    field: str  # key inside the secret's data
    kv_version: Literal[1, 2]
    placeholder: str  # what a sandbox may hold instead of the value (SDKs refuse an empty key)
    source: Source
    # `hosts:` the only hosts it may be sent to (proved by sandgate.review.proofs); None: any
    hosts: tuple[HostPattern, ...] | None = None
    # minted per sandbox with a lease instead of read from KV (then mount/path/field are unused)
    dynamic: DynamicRef | None = None
    budget: SecretBudget | None = None  # call budget per window (sandgate.limits)
    oauth2: OAuth2Ref | None = None  # an OAuth 2.0 access token minted from the KV record
    github_app: GitHubAppRef | None = None  # a GitHub App installation token
    aws: AwsRef | None = None  # SigV4 signing credentials (only for `inject: {sign: NAME}`)

    @property
    def location(self) -> str:
        """Where it is read, unresolved: "mount/path" (KV) or the dynamic engine's path."""
        if self.dynamic is not None:
            return self.dynamic.path
        return f"{self.mount}/{self.path}"

    @property
    def per_sandbox(self) -> bool:
        """Each sandbox gets its own value: a dynamic secret, or a path using {{ sandbox }}.
        A caller without a sandbox id is refused (sandbox_required) on a rule that needs it."""
        return self.dynamic is not None or path_variable("sandbox") in self.location

    @property
    def per_identity(self) -> bool:
        return path_variable("identity") in self.location


@dataclass(frozen=True, slots=True)
class SecretSlot:
    """A `{{ secrets.NAME }}` hole inside a template; `{{ secrets.NAME.username }}` has
    part "username" (the user name a dynamic secret was minted with)."""

    name: str
    part: str | None = None

    @property
    def key(self) -> str:
        """Its key in the values a template is rendered from: "NAME" or "NAME.username"."""
        return self.name if self.part is None else f"{self.name}.{self.part}"


@dataclass(frozen=True, slots=True)
class Template:
    """A parsed injection template: literal strings and secret slots, in order."""

    parts: tuple[str | SecretSlot, ...]

    @property
    def secrets(self) -> frozenset[str]:
        return frozenset(p.name for p in self.parts if isinstance(p, SecretSlot))

    def render(self, values: Mapping[str, str]) -> str:
        return "".join(values[p.key] if isinstance(p, SecretSlot) else p for p in self.parts)

    @property
    def keys(self) -> frozenset[str]:
        """The value keys `render` needs."""
        return frozenset(p.key for p in self.parts if isinstance(p, SecretSlot))


@dataclass(frozen=True, slots=True)
class Injection:
    headers: tuple[tuple[str, Template], ...] = ()  # header names lower-cased
    basic: tuple[Template, Template] | None = None  # (user, password) -> Authorization: Basic
    query: tuple[tuple[str, Template], ...] = ()
    sign: SignRef | None = None  # an `aws:` secret: the request is signed with SigV4

    @property
    def secrets(self) -> frozenset[str]:
        out: set[str] = {self.sign.secret} if self.sign else set()
        for _, t in self.headers:
            out |= t.secrets
        for _, t in self.query:
            out |= t.secrets
        if self.basic:
            out |= self.basic[0].secrets | self.basic[1].secrets
        return frozenset(out)


@dataclass(frozen=True, slots=True)
class HostPattern:
    """An exact host or a leading `*.` wildcard (matches one or more labels, not the apex)."""

    text: str  # normalised pattern as written, e.g. "*.github.com"
    wildcard: bool
    suffix: str  # for wildcards ".github.com"; for exact hosts the host itself

    def matches(self, host: str) -> bool:
        if self.wildcard:
            return host.endswith(self.suffix) and len(host) > len(self.suffix)
        return host == self.suffix


# The host pattern of a `public: true` rule: every host (a wildcard over the empty suffix). The
# address step then refuses any name that resolves to a non-public address, so what the rule
# reaches is "any host that resolves only to public addresses". overlap and the proofs treat it
# as the wildcard it is: it covers every pattern, and its witness is a host no other pattern
# matches.
ANY_PUBLIC_HOST = HostPattern(text="public: true", wildcard=True, suffix="")

# `query:` constraints of a rule: (parameter name, the values it may have), in file order.
QueryConstraint = tuple[tuple[str, frozenset[str]], ...]


def query_matches(constraints: QueryConstraint,
                  query: tuple[tuple[str, str], ...] | None,
                  optional: QueryConstraint = (), absent: frozenset[str] = frozenset()) -> bool:
    """Each constrained parameter is present, every occurrence of it carries the same value,
    and that value is one of those listed; each `optional` one is either missing or so; each
    `absent` one is missing (in any letter case). `query` is the request's decoded parameters
    (sandgate.request.parse_query); None (a query that cannot be read unambiguously) matches
    no constraint. A parameter given twice with different values is ambiguous (servers differ
    on which one they use), so it matches nothing."""
    if not constraints and not optional and not absent:
        return True
    if query is None:
        return False
    for name, allowed in (*constraints, *optional):
        # A differently cased spelling of the name is the same parameter to some servers.
        folded = name.casefold()
        if any(n != name and n.casefold() == folded for n, _ in query):
            return False
        values = {v for n, v in query if n == name}
        if not values and (name, allowed) in optional:
            continue
        if len(values) != 1 or next(iter(values)) not in allowed:
            return False
    folded_names = {n.casefold() for n, _ in query}
    return not any(name.casefold() in folded_names for name in absent)


# The MCP methods a rule with `mcp:` allows when it lists no `methods`: the protocol's own
# housekeeping, the list calls and tools/call (each tool then judged by `tools`/`deny_tools`).
# server/discover is the 2026-07-28 revision's counterpart of initialize.
MCP_DEFAULT_METHODS = ("initialize", "server/discover", "notifications/*", "ping", "tools/list",
                       "resources/list", "prompts/list", "tools/call")
# What an MCP session does besides its calls: opening it, keeping it alive, listing. An `action:
# ask` rule does not hold these (every session would wait for approvers before its first
# call) unless its `mcp:` says `ask_housekeeping: true`; it holds tools/call, resources/read,
# prompts/get, completion/complete and every other method. Answers to the server's requests
# (sampling, elicitation, roots) are not calls and are not held either.
MCP_HOUSEKEEPING = ("initialize", "server/discover", "notifications/*", "ping", "tools/list",
                    "resources/list", "resources/templates/list", "prompts/list",
                    "logging/setLevel")
DEFAULT_CALL_BODY = 64 * 1024  # the bounded body of a JSON-RPC rule (OpenShell's limit too)


def glob_matches(pattern: str, text: str) -> bool:
    """A call-level glob: `*` any run of characters ('/' included), `?` one; nothing else is
    special. Case-sensitive, whole string."""
    return _glob_re(pattern).fullmatch(text) is not None


@functools.lru_cache(maxsize=4096)
def _glob_re(pattern: str) -> re.Pattern[str]:
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c)
                              for c in pattern), re.DOTALL)


@dataclass(frozen=True, slots=True)
class CallFilter:
    """`mcp:` or `jsonrpc:` of a rule: what JSON-RPC calls in its request bodies may do.

    A message is allowed when its method matches `methods` (None: MCP_DEFAULT_METHODS, plus
    resources/read and prompts/get when `resources`/`prompts` are named; generic JSON-RPC: any)
    and no `deny_methods`; a tools/call also needs its tool in `tools` (None: any) and not in
    `deny_tools`, and its `arguments` constraints met; resources/read and prompts/get their uri
    or name in `resources`/`prompts` (None: any). Deny entries win over every allow.

    `websocket`: the rule's `websocket: true`. Without it a protocol upgrade (WebSocket or any
    other) on the rule's requests is refused (upgrade_refused); with it a WebSocket is allowed
    and each of its messages is judged as a body is (sandgate.stages.wsrpc).
    """

    protocol: Literal["mcp", "jsonrpc"]
    methods: tuple[str, ...] | None = None
    deny_methods: tuple[str, ...] = ()
    tools: tuple[str, ...] | None = None
    deny_tools: tuple[str, ...] = ()
    arguments: tuple[tuple[str, str], ...] = ()  # (argument name, glob its string value matches)
    resources: tuple[str, ...] | None = None
    prompts: tuple[str, ...] | None = None
    max_body: int = DEFAULT_CALL_BODY
    websocket: bool = False
    # on an ask rule: hold MCP housekeeping too (MCP_HOUSEKEEPING; default: it is not held)
    ask_housekeeping: bool = False

    @property
    def allowed_methods(self) -> tuple[str, ...] | None:
        if self.methods is not None or self.protocol == "jsonrpc":
            return self.methods
        extra = (("resources/read",) if self.resources is not None else ()) + (
            ("prompts/get",) if self.prompts is not None else ())
        return MCP_DEFAULT_METHODS + extra


# Where the official SDKs carry an API key: OpenAI (authorization: Bearer), Anthropic (x-api-key),
# Azure OpenAI (api-key).
DEFAULT_SUBSTITUTE_HEADERS = frozenset({"authorization", "x-api-key", "api-key"})


@dataclass(frozen=True, slots=True)
class RuleMeta:
    """What a rule says about itself for reviewers; never part of a decision."""

    description: str | None = None
    owner: str | None = None
    ticket: str | None = None
    expires: date | None = None  # `sandgate check` fails from this day on
    # `lint: {ignore: [CODE], why: ...}`: lint warnings on this rule known and accepted
    lint_ignore: tuple[str, ...] = ()
    lint_why: str | None = None


# Where a remembered approval applies (sandgate.approvals): this request only, the caller's
# sandbox for a TTL, or the caller's identity for a TTL.
ApprovalScope = Literal["request", "sandbox", "identity"]
DEFAULT_ASK_TIMEOUT = 120  # seconds a held request waits (SDK timeouts are 60 s to 10 min)
MAX_HOLD_TIMEOUT = 900  # a held connection is kept open at most this long (mode: hold)
MAX_ASYNC_TIMEOUT = 7 * 24 * 3600  # an async approval stays pending at most this long
DEFAULT_REMEMBER_TTL = 3600  # a remembered grant without a ttl
MAX_REMEMBER_TTL = 30 * 24 * 3600


@dataclass(frozen=True, slots=True)
class AskPolicy:
    """`action: ask` and its `approval:` settings: a matching request is held (or answered 202,
    mode async) until people decide (sandgate.approvals)."""

    timeout: int = DEFAULT_ASK_TIMEOUT  # seconds until 403 approval_timeout
    require_approvers: int = 1  # distinct approvers whose approval it takes (two-person rule)
    approvers: tuple[str, ...] | None = None  # the admin users who may decide; None: any approver
    mode: Literal["hold", "async"] = "hold"
    remember: tuple[ApprovalScope, ...] = ("request",)  # scopes an approver may choose
    max_remember_ttl: int = DEFAULT_REMEMBER_TTL * 24  # cap on a remembered grant's ttl
    webhook: str | None = None  # a `webhooks:` name, notified of each new approval request


@dataclass(frozen=True, slots=True)
class Webhook:
    """A policy's `webhooks:` entry: where new approval requests are announced."""

    name: str
    url: str
    format: Literal["slack", "json"]
    secret: str | None  # the `secrets:` name whose value is the HMAC key (None: unsigned)
    source: Source


@dataclass(frozen=True, slots=True)
class LlmRule:
    """`llm:` of a rule: its requests are LLM API calls (sandgate.llm.llmcall), judged by model and
    output cap, and counted against a budget (sandgate.llm.spend)."""

    api: Literal["anthropic", "openai", "gemini"] | None = None  # None: by the provider's host
    models: tuple[str, ...] | None = None  # globs (glob_matches) a call's model must match
    max_tokens: int | None = None  # the largest output cap a call may ask for
    on_max_tokens: Literal["refuse", "lower"] = "refuse"  # over the cap (or none given)
    budget: str | None = None  # a `budgets:` name
    # a credential the sandbox brought itself, on a rule that injects one (stages/s37_llm)
    own_credentials: Literal["refuse", "replace"] = "refuse"
    # the rule's `websocket: true`: the Responses API's WebSocket transport may be opened on
    # its URLs, each `response.create` on it judged as a POST body (sandgate.stages.wsllm);
    # without it a protocol upgrade on the rule's requests is refused (upgrade_refused)
    websocket: bool = False


@dataclass(frozen=True, slots=True)
class Budget:
    """A `budgets:` entry: spend per window of `per` seconds, per identity or per sandbox,
    shared by every rule naming it. A limit left None is not limited."""

    name: str
    per: int
    scope: Literal["identity", "sandbox"]
    source: Source
    input_tokens: int | None = None
    output_tokens: int | None = None
    cost_usd: float | None = None


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens of the models matching `model` (a glob)."""

    model: str
    input: float
    output: float
    cached_input: float | None = None  # None: as `input`


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    identity: str
    action: Literal["allow", "deny"]
    schemes: frozenset[str]  # {"https"} unless the rule says otherwise
    hosts: tuple[HostPattern, ...]
    ports: frozenset[int]  # resolved at load time: default 443 for https, 80 for http
    methods: frozenset[str] | None  # None: any method
    paths: tuple[PathPattern, ...] | None  # None: any path
    inject: Injection | None
    substitute: frozenset[str]  # secrets whose placeholders are swapped for values on this rule
    substitute_headers: frozenset[str]  # ...only in these request headers (lower case)
    private_cidrs: tuple[IPNetwork, ...]  # non-public ranges this rule may dial
    passthrough: bool  # tunnel without interception: no L7 match, no injection, no scrubbing
    source: Source
    query: QueryConstraint = ()  # named query parameters and their allowed values
    query_optional: QueryConstraint = ()  # may be missing; when given, one of these values
    query_absent: frozenset[str] = frozenset()  # must be missing, in any letter case
    max_request_bytes: int | None = None  # the rule's own request body limit (413 above it)
    # `substitute_body: true`: `substitute` placeholders are swapped in JSON/form body values too
    # (sandgate.secrets.body)
    substitute_body: bool = False
    github_scope: GitHubScope | None = None  # `github_app:` restrictions of its tokens
    public: bool = False  # `public: true`: hosts is (ANY_PUBLIC_HOST,)
    # where the rule is written inside source.file, e.g. ("identities", "a", "rules", 2) or
    # ("templates", "git", 0): for tools that point at one of its fields (lint)
    where: tuple[str | int, ...] = ()
    meta: RuleMeta | None = None  # description, owner, ticket, expires (None: none given)
    call: CallFilter | None = None  # `mcp:` / `jsonrpc:`: the calls in its bodies are judged
    # `action: ask`: an allow rule whose requests wait for approval (compiled as action "allow"
    # so that every analysis (reach, proofs, secrets' hosts) counts what it reaches once
    # approved; deny > ask > allow when several match: sandgate.decision)
    ask: AskPolicy | None = None
    # `dns: {types: [...]}`: query types beyond A/AAAA the policy DNS answers for its hosts
    dns_types: frozenset[str] = frozenset()
    # `forward_trace_context: true`: the sandbox's traceparent/tracestate reach the upstream
    # (otherwise removed before forwarding: sandgate.audit.export.traceparent)
    forward_trace_context: bool = False
    # A signing rule's (`inject: {sign}`) `operations:`: globs over the X-Amz-Target or Action
    # a request names (None: any operation), and `copy_sources:`: the objects an
    # x-amz-copy-source / x-amz-rename-source may name, matched like `paths` (None: none)
    # (sandgate.secrets.aws_request)
    operations: tuple[str, ...] | None = None
    copy_sources: tuple[PathPattern, ...] | None = None
    llm: LlmRule | None = None  # `llm:`: model allow-list, output cap, budget (sandgate.llm.spend)

    @property
    def verb(self) -> Literal["allow", "deny", "ask"]:
        """The action as written: allow, deny or ask."""
        return "ask" if self.ask is not None else self.action

    @property
    def secrets(self) -> frozenset[str]:
        """Every secret this rule binds: the only ones whose placeholders it honours."""
        return (self.inject.secrets if self.inject else frozenset()) | self.substitute

    def matches_host(self, host: str) -> bool:
        return any(p.matches(host) for p in self.hosts)

    def matches_query(self, query: tuple[tuple[str, str], ...] | None) -> bool:
        return query_matches(self.query, query, self.query_optional, self.query_absent)

    @property
    def query_constrained(self) -> bool:
        """Does the rule look at the query at all (`query:` in any form)?"""
        return bool(self.query or self.query_optional or self.query_absent)


@dataclass(frozen=True, slots=True)
class Identity:
    name: str
    rules: tuple[Rule, ...]
    source: Source
    # "report": policy refusals (no_rule, denied_by_rule) are forwarded uninjected and audited
    mode: Literal["enforce", "report"] = "enforce"
    narrower_than: str | None = None  # proved by sandgate.review.proofs
    limits: IdentityLimits | None = None  # rate and connection limits (sandgate.limits)
    owns: tuple[str, ...] | None = None  # the only files that may add rules (file names)


@dataclass(frozen=True, slots=True)
class PolicyTest:
    """A fixture from a file's `tests:` list, run by `sandgate check`."""

    identity: str
    method: str
    url: str
    expect: Literal["allow", "deny", "tunnel", "ask", "resolve", "refuse"]
    rule: str | None  # when set, the decision must name this rule
    source: Source
    inject: frozenset[str] | None = None  # when set, exactly these secrets are used (or none)
    code: str | None = None  # when set, the refusal's code
    passthrough: bool | None = None  # CONNECT fixtures: tunnelled without interception?
    sandbox: str | None = None  # the caller's sandbox id (None: the caller has none)
    gateway: bool = False  # url is a gateway path, judged as the gateway listener judges it
    call: Call | None = None  # `mcp:` / `jsonrpc:`: the JSON-RPC call its body carries
    websocket: bool = False  # the request opens a WebSocket (the call: a message on it)
    # a `dns:` fixture (method "DNS", url the name): the query type looked up
    qtype: str | None = None
    headers: tuple[tuple[str, str], ...] = ()  # `headers:`: (lower-case name, value)
    # `model:` / `max_tokens:`: the request is an LLM call asking for these (sandgate.llm.llmcall)
    model: str | None = None
    max_tokens: int | None = None

    @property
    def dns(self) -> bool:
        """A `dns: NAME` fixture, judged by the policy DNS's decision (decide_name)."""
        return self.qtype is not None

    @property
    def connect(self) -> bool:
        """A `CONNECT host:port` fixture (url is the authority)."""
        return self.method == "CONNECT"


@dataclass(frozen=True, slots=True)
class Gateway:
    """A `gateways:` entry: requests under `prefix` on the gateway listener go to the upstream
    (always https, TLS verified), with the caller's token read from (and removed from)
    `token_header`."""

    prefix: str  # "/anthropic": one or more plain segments, no trailing slash
    host: str  # normalised upstream host
    port: int
    token_headers: tuple[str, ...]  # lower case; exactly one carries the caller's token
    source: Source

    @property
    def upstream(self) -> str:
        return f"https://{self.host}" + ("" if self.port == 443 else f":{self.port}")


@dataclass(frozen=True, slots=True)
class Policy:
    identities: Mapping[str, Identity]
    secrets: Mapping[str, SecretRef]
    tests: tuple[PolicyTest, ...] = ()
    files: tuple[str, ...] = field(default=())
    templates: Mapping[str, Source] = field(default_factory=dict)  # name -> where defined
    gateways: tuple[Gateway, ...] = ()  # `gateways:` of every file, prefixes unique
    webhooks: Mapping[str, Webhook] = field(default_factory=dict)  # approval announcements
    budgets: Mapping[str, Budget] = field(default_factory=dict)  # `budgets:` of every file
    # `prices:` of every file, first match wins, before the shipped table (sandgate.llm.spend)
    prices: tuple[Price, ...] = ()

    @property
    def placeholders(self) -> Mapping[str, str]:
        """placeholder text -> secret name."""
        return {s.placeholder: s.name for s in self.secrets.values()}
