"""The policy FILE FORMAT (v1), as pydantic models.

These check shape and types only (unknown keys, wrong types, missing fields). Meaning (host
globs, templates, secret references, cross-file duplicates) is checked when the loader compiles
them into sandgate.policy.model types. `sandgate schema` prints the JSON Schema of PolicyFile.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import date
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Where in a policy file (a path of keys and list indices), and the one way a compile step
# reports a problem there: (loc, message, fix). Shared by every compile step of sandgate.policy.
Loc = tuple[str | int, ...]
Report = Callable[[Loc, str, str], None]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class DynamicSpec(_Strict):
    """A secret minted per sandbox by a Vault/OpenBao engine that answers with a lease."""

    path: str = Field(description="The engine path to read, e.g. database/creds/readonly. May "
                      "use {{ identity }} and {{ sandbox }}.")
    field: str = Field(default="password",
                       description="The key of the credential in the answer's data.")
    username_field: str | None = Field(
        default=None, description="The key of the user name it was minted with (e.g. "
        "username), for `{{ secrets.NAME.username }}` in templates.")
class OAuth2Spec(_Strict):
    """An OAuth 2.0 access token Sandgate obtains itself (docs/credentials.md). The secret's
    `vault:` path (KV v2) holds `client_id`, `client_secret` and, for the refresh-token grant,
    `refresh_token`; a rotated refresh token is written back there (check-and-set)."""

    token_url: str = Field(description="The token endpoint, https only. Sandgate dials it "
                           "itself, under the same rules and address checks as any request of "
                           "the calling identity: one of its rules must allow POST to it.")
    grant: Literal["client_credentials", "refresh_token"] = Field(
        description="client_credentials, or refresh_token (the refresh token read from Vault).")
    scope: str | None = Field(default=None, description="The `scope` asked for, if any.")
    client_auth: Literal["basic", "post"] = Field(
        default="basic", description="How the client authenticates: HTTP Basic "
        "(client_secret_basic, the default) or form fields (client_secret_post).")
    timeout: float = Field(default=10.0, gt=0, le=60, description="Seconds the token request "
                           "may take in all; past it: 503 secret_unavailable.")


class GitHubAppSpec(_Strict):
    """A GitHub App installation token Sandgate mints itself (docs/credentials.md). The
    secret's `vault:` path holds the app's private key (PEM) under `field` (default
    private_key)."""

    app_id: int = Field(description="The GitHub App's id (the JWT's issuer).")
    installation_id: int = Field(description="The installation the tokens are minted for.")
    api_url: str = Field(default="https://api.github.com", description="GitHub's API (https), "
                         "e.g. https://github.example.com/api/v3 for GitHub Enterprise Server. "
                         "Sandgate POSTs to {api_url}/app/installations/{id}/access_tokens: "
                         "the calling identity's rules must allow it.")
    timeout: float = Field(default=10.0, gt=0, le=60,
                           description="Seconds a mint or revocation may take in all.")


class GitHubTokenSpec(_Strict):
    """`github_app:` of a rule: what the installation token it injects may do (narrower per
    identity: a bash tool gets contents: read on one repository)."""

    repositories: list[str] | None = Field(
        default=None, min_length=1, description="The repositories the token is restricted to "
        "(name, or owner/name within the installation's account). Default: the installation's.")
    permissions: dict[str, Literal["read", "write", "admin"]] | None = Field(
        default=None, min_length=1, description="The permissions the token gets, e.g. "
        "{contents: read, pull_requests: write}. Default: the installation's.")


class AwsSpec(_Strict):
    """AWS credentials for SigV4 signing by Sandgate (a rule's `inject: {sign: NAME}`). The
    secret's `vault:` path holds access_key_id, secret_access_key and, for temporary
    credentials, session_token."""

    region: str | None = Field(
        default=None, description="The region requests are signed for, e.g. eu-west-1. "
        "Default: the rule's `sign.region`, else the request's AWS endpoint host.")
    service: str | None = Field(
        default=None, description="The signing name of the service, e.g. s3, sqs, dynamodb, "
        "execute-api. Default: the rule's `sign.service`, else the request's AWS endpoint "
        "host.")


class SignSpec(_Strict):
    """`inject: {sign: {secret: NAME, service: S, region: R}}`: the rule's signing scope,
    which wins over the secret's `aws:` and over the request's host."""

    secret: str = Field(description="The `aws:` secret whose keys sign.")
    service: str | None = Field(default=None, description="The signing name, e.g. s3, sqs.")
    region: str | None = Field(default=None, description="The region, e.g. eu-west-1.")


class BudgetSpec(_Strict):
    """A call budget for an expensive credential, counted per Sandgate process."""

    calls: int = Field(description="How many requests may have this secret injected per window "
                       "(at least 1). Past it: 429 budget_exhausted with Retry-After.")
    per: str | int = Field(description="The window: 30s, 15m, 1h, 7d, or seconds as an integer.")


class LimitsSpec(_Strict):
    """Limits for one identity; each overrides the matching `sandgate run` flag."""

    rps: float | None = Field(
        default=None, description="Requests per second (token bucket), e.g. 5 or 0.5. Past it: "
        "429 rate_limited with Retry-After. Overrides --rps.")
    burst: int | None = Field(
        default=None, description="How many requests may come at once before rps applies "
        "(default: rps rounded up). Overrides --burst.")
    max_connections: int | None = Field(
        default=None, description="Client connections open at once; a new one past it gets "
        "429 too_many_connections. Overrides --max-connections-per-identity.")


class SecretSpec(_Strict):
    """Where a secret lives in Vault. Exactly one of `vault`, `mount` + `path`, or `dynamic`.

    Paths may use `{{ identity }}` and `{{ sandbox }}` (e.g.
    secret/data/sandboxes/{{ sandbox }}/github): filled from the caller; a caller without a
    sandbox id is refused (sandbox_required) on a rule needing a per-sandbox secret."""

    vault: str | None = Field(
        default=None,
        description="Full KV v2 API path, e.g. secret/data/llm/anthropic (mount 'secret').",
    )
    mount: str | None = Field(default=None, description="KV mount point, e.g. 'kv'.")
    path: str | None = Field(default=None, description="Path inside the mount.")
    field: str | None = Field(default=None,
                              description="Key inside the secret's data (KV secrets).")
    dynamic: DynamicSpec | None = Field(
        default=None, description="Minted per sandbox with a lease (database/creds/ROLE...), "
        "renewed while the sandbox lives and revoked when it ends.")
    kv_version: Literal[1, 2] = Field(default=2, description="KV engine version (mount form).")
    aws: AwsSpec | None = Field(
        default=None, description="AWS credentials (access_key_id, secret_access_key, "
        "session_token) at the `vault:` path, used only to sign requests (`inject: {sign: "
        "NAME}`); `field` is not needed.")
    github_app: GitHubAppSpec | None = Field(
        default=None, description="The value is a GitHub App installation token Sandgate "
        "mints with the app's private key read from the `vault:` path (field private_key), "
        "per sandbox and per rule's `github_app:` restrictions, cached until near expiry and "
        "revoked when the sandbox ends.")
    oauth2: OAuth2Spec | None = Field(
        default=None, description="The value is an OAuth 2.0 access token Sandgate obtains "
        "from `token_url` with the client credentials read from the `vault:` path (KV v2), "
        "cached until shortly before it expires. `field` is not needed.")
    placeholder: str | None = Field(
        default=None,
        description="Text a sandbox may hold instead of the value; default "
        "sandgate-placeholder-<name>. At least 8 characters, unique.",
    )
    hosts: list[str] | None = Field(
        default=None, min_length=1,
        description="The only hosts this secret may ever be sent to (exact hosts or '*.domain' "
        "wildcards). `sandgate check` proves that no allow rule injecting or substituting it "
        "can match a host outside them. Default: not checked.",
    )
    budget: BudgetSpec | None = Field(
        default=None, description="At most `calls` injections of this secret per `per` window, "
        "e.g. {calls: 1000, per: 1h}; counted per Sandgate process.")


class BasicSpec(_Strict):
    username: str
    password: str


class InjectSpec(_Strict):
    """Credentials added to an allowed request. Values are templates: literal text plus
    `{{ secrets.NAME }}`."""

    headers: dict[str, str] = Field(default_factory=dict)
    basic: BasicSpec | None = None
    query: dict[str, str] = Field(default_factory=dict)
    sign: str | SignSpec | None = Field(
        default=None, description="An `aws:` secret (NAME, or {secret: NAME, service: S, "
        "region: R}): Sandgate signs the request with AWS SigV4; service and region come "
        "from here, else the secret's `aws:`, else the request's AWS endpoint host "
        "(s3.eu-west-1.amazonaws.com, sts.amazonaws.com as us-east-1). The client's "
        "Authorization and X-Amz-Date / "
        "X-Amz-Content-SHA256 / X-Amz-Security-Token headers are removed first; the payload "
        "is sent as "
        "UNSIGNED-PAYLOAD for s3 and hashed for other services; streaming (aws-chunked) "
        "payloads are refused.")


class JsonRpcSpec(_Strict):
    """Generic JSON-RPC 2.0 over HTTP POST: each message of a request body is judged."""

    methods: list[str] | None = Field(
        default=None, min_length=1, description="JSON-RPC methods allowed (exact names or "
        "globs: '*' any run of characters, '?' one). Default: any method.")
    deny_methods: list[str] = Field(
        default_factory=list, description="Methods refused even when `methods` allows them "
        "(deny entries win, in every rule of the identity that matches the request).")
    max_body: int | str | None = Field(
        default=None, description="The largest body judged, e.g. 64k (the default) or 1m: "
        "larger bodies are refused (413 too_large), never forwarded unjudged.")


class McpSpec(JsonRpcSpec):
    """An MCP server (streamable HTTP): each JSON-RPC message POSTed is judged, tools/call by
    the tool's name, and the server's list answers (tools/list, resources/list,
    resources/templates/list, prompts/list, server/discover) are filtered to what the identity
    may call."""

    methods: list[str] | None = Field(
        default=None, min_length=1, description="MCP methods allowed (names or globs). "
        "Default: initialize, server/discover, notifications/*, ping, tools/list, "
        "resources/list, prompts/list and tools/call (plus resources/read and prompts/get when "
        "`resources`/`prompts` are set). Listing methods replaces the default: list only what "
        "you allow.")
    tools: list[str] | None = Field(
        default=None, min_length=1, description="Tools that tools/call may name (exact names "
        "or globs such as 'get_*'). Default: any tool.")
    deny_tools: list[str] = Field(
        default_factory=list, description="Tools refused even when `tools` allows them.")
    arguments: dict[str, str] | None = Field(
        default=None, min_length=1, description="Constraints on every tools/call of this "
        "rule: each named argument must be present, a string, and match the glob, e.g. "
        "{repo: 'acme/*'}.")
    resources: list[str] | None = Field(
        default=None, min_length=1, description="Resource URIs resources/read may name "
        "(globs); setting it allows resources/read. Default: resources/read is not allowed.")
    prompts: list[str] | None = Field(
        default=None, min_length=1, description="Prompts prompts/get may name (globs); "
        "setting it allows prompts/get. Default: prompts/get is not allowed.")
    ask_housekeeping: bool = Field(
        default=False, description="On an `action: ask` rule: hold the session's housekeeping "
        "too (initialize, notifications, ping, the list calls, logging/setLevel, and the "
        "bodiless GET stream and DELETE). Default: only tools/call, resources/read, "
        "prompts/get and other methods wait for approval.")


class LintSpec(_Strict):
    """`lint:` of a rule: warnings of `sandgate lint` suppressed on it, with the reason."""

    ignore: list[str] = Field(
        min_length=1, description="Codes of the warnings to suppress on this rule (the code "
        "`sandgate lint` prints in brackets, e.g. java-path-params).")
    why: str | None = Field(
        default=None, description="Required: why the warning does not apply here, for "
        "reviewers (shown by `sandgate report`).")


class QuerySpec(_Strict):
    """One `query:` parameter written as a mapping."""

    values: list[str] = Field(default_factory=list,
                              description="The values it may have (decoded).")
    optional: bool = Field(default=False, description="It may be missing; when given, it "
                           "must have one of `values`.")
    exact: bool = Field(default=False, description="The name's capitals or a '+' in a value "
                        "are meant (the API spells it so, and clients send '+' as %2B).")


class ApprovalSpec(_Strict):
    """`approval:` of an `action: ask` rule: who decides, how long the request waits, what a
    decision may be remembered for (docs/approvals.md)."""

    timeout: int | str = Field(
        default=120, description="How long the request waits for a decision: seconds, or 30s, "
        "2m, 1h. Default 120 s; at most 15m in mode hold (the client's connection stays open "
        "meanwhile), 7d in mode async. Past it: 403 approval_timeout.")
    require_approvers: int = Field(
        default=1, ge=1, le=10, description="How many distinct approvers must approve (a "
        "two-person rule: 2). One deny refuses.")
    approvers: list[str] | None = Field(
        default=None, min_length=1, description="The admin users (--admin-users names) who "
        "may decide. Default: any user with role approver or admin.")
    mode: Literal["hold", "async"] = Field(
        default="hold", description="hold: the request waits, its connection open, until a "
        "decision or the timeout. async: it is answered 202 with Retry-After and an approval "
        "id at once; once approved, the identical request (same identity, sandbox, method, "
        "URL, body) passes.")
    remember: list[Literal["request", "sandbox", "identity"]] = Field(
        default_factory=lambda: list[Literal["request", "sandbox", "identity"]](["request"]),
        min_length=1, description="The scopes an approver "
        "may choose: request (this request only), sandbox (every request this rule matches "
        "from the caller's sandbox, for a ttl), identity (from the caller's identity, for a "
        "ttl).")
    max_remember_ttl: int | str = Field(
        default=86400, description="The longest ttl a remembered decision may have (seconds, "
        "or 15m, 8h, 7d; default 1d).")
    webhook: str | None = Field(
        default=None, description="A `webhooks:` name: each new approval request is posted "
        "there.")


class WebhookSpec(_Strict):
    """Where new approval requests are announced (`webhooks:`, docs/approvals.md)."""

    url: str = Field(description="The receiver: https (or http to a loopback address), e.g. a "
                     "Slack incoming webhook URL.")
    format: Literal["slack", "json"] = Field(
        default="json", description="slack: a Slack-compatible incoming-webhook message "
        "(`text` and `blocks`); json: Sandgate's own JSON body.")
    secret: str | None = Field(
        default=None, description="A `secrets:` name whose value is the HMAC key: each post "
        "carries X-Sandgate-Timestamp and X-Sandgate-Signature: sha256=HEX of "
        "'TIMESTAMP.BODY'.")


class LlmSpec(_Strict):
    """The rule's requests are LLM API calls: judged by model and output cap, counted against a
    budget (docs/spend.md)."""

    api: Literal["anthropic", "openai", "gemini"] | None = Field(
        default=None, description="The API the rule's hosts speak: anthropic (Messages), openai "
        "(chat completions and Responses, OpenAI-compatible servers too) or gemini "
        "(generateContent). Default: known by the provider's own host (api.anthropic.com, "
        "api.openai.com, generativelanguage.googleapis.com).")
    models: list[str] | None = Field(
        default=None, min_length=1, description="Globs the call's model must match, e.g. "
        "[\"claude-sonnet-*\", \"gpt-4.1-mini\"] ('*' any run of characters). Another model: "
        "403 model_not_allowed. Default: any model.")
    max_tokens: int | None = Field(
        default=None, description="The largest output cap a call may ask for (max_tokens, "
        "max_completion_tokens, max_output_tokens, generationConfig.maxOutputTokens). A call "
        "asking for more, or for none: see on_max_tokens.")
    on_max_tokens: Literal["refuse", "lower"] = Field(
        default="refuse", description="refuse (400 max_tokens_over_cap) or lower (the cap is "
        "set to max_tokens in the forwarded body) a call over the cap or without one.")
    own_credentials: Literal["refuse", "replace"] = Field(
        default="refuse", description="On a rule that injects a credential: a credential "
        "the sandbox brought itself (its own authorization, x-api-key, api-key, "
        "x-goog-api-key header or `key` query parameter, not a placeholder) is refused (403 "
        "own_credential) or removed before the injection (replace). The audit says which.")
    budget: str | None = Field(
        default=None, description="A `budgets:` name: the call reserves its worst case "
        "before it is forwarded and settles its real usage when it ends.")


class BudgetDefSpec(_Strict):
    """A token and cost budget per window, shared by the rules whose `llm.budget` names it."""

    input_tokens: int | None = Field(default=None, description="Input tokens per window.")
    output_tokens: int | None = Field(default=None, description="Output tokens per window.")
    cost_usd: float | int | None = Field(
        default=None, description="US dollars per window, priced by `prices:` and the "
        "shipped price table.")
    per: str | int = Field(description="The window: 30s, 15m, 1h, 1d, or seconds.")
    scope: Literal["identity", "sandbox"] = Field(
        default="identity", description="Counted per calling identity, or per sandbox "
        "(a caller without a sandbox id is refused: sandbox_required).")


class PriceSpec(_Strict):
    """A price in US dollars per million tokens, for the models matching `model`."""

    model: str = Field(description="A glob over model names, e.g. claude-sonnet-4*.")
    input: float | int = Field(description="Per million input tokens.")
    output: float | int = Field(description="Per million output tokens.")
    cached_input: float | int | None = Field(
        default=None, description="Per million input tokens read from the cache (default: "
        "input).")


class DnsSpec(_Strict):
    """`dns:` of a rule: what the policy DNS (`sandgate run --dns`) answers for its hosts
    beyond A and AAAA (docs/dns.md)."""

    types: list[str] = Field(
        min_length=1, description="Query types also answered for the names this rule could "
        "reach, e.g. [TXT] or [MX, SRV]: each is a channel through DNS, so name only what a "
        "client needs. A and AAAA are always answered; ANY, AXFR, IXFR and meta types never.")


class RuleSpec(_Strict):
    name: str
    action: Literal["allow", "deny", "ask"] = Field(
        default="allow", description="allow, deny, or ask: like allow, but each request waits "
        "for approval (`approval:`). When several rules match, deny wins over ask, and ask "
        "over allow.")
    approval: ApprovalSpec | None = Field(
        default=None, description="For `action: ask`: timeout, approvers, mode, remember, "
        "webhook.")
    # The spelling (#26): `timeout` and `require_approvers` on the rule itself, as
    # shorthands of the same keys under `approval:` (one place or the other, never both).
    timeout: int | str | None = Field(
        default=None, description="For `action: ask`: the same as `approval.timeout` (how "
        "long a request waits for a decision: seconds, or 30s, 2m, 1h).")
    require_approvers: int | None = Field(
        default=None, ge=1, le=10, description="For `action: ask`: the same as "
        "`approval.require_approvers` (distinct approvers needed; 2 is a two-person rule).")
    hosts: list[str] | None = Field(
        default=None, min_length=1,
        description="Exact hosts or '*.domain' wildcards. Required unless `public: true`.")
    public: bool = Field(
        default=False,
        description="Instead of `hosts`: any host that resolves only to public addresses. The "
        "rule matches every host name (and IP literal); the proxy then refuses "
        "(internal_address) a host any of whose addresses is non-public. Cannot inject, "
        "substitute, pass through or have private_cidrs.",
    )
    schemes: list[Literal["https", "http"]] | None = Field(default=None, min_length=1)
    ports: list[int] | None = Field(
        default=None, min_length=1, description="Default: 443 for https, 80 for http."
    )
    methods: list[str] | None = Field(default=None, min_length=1, description="Default: any.")
    paths: list[str] | None = Field(
        default=None, min_length=1, description="Path globs; default: any path."
    )
    inject: InjectSpec | None = None
    operations: list[str] | None = Field(
        default=None, min_length=1,
        description="For a rule that signs (`inject: {sign: ...}`): the AWS operations it "
        "signs, as globs over the X-Amz-Target header (JSON protocol, e.g. "
        "DynamoDB_20120810.GetItem or '*.GetItem') or the Action parameter in the query or "
        "form body (query protocol, e.g. SendMessage). A request naming another operation, "
        "none, or more than one is not signed by this rule. Default: any operation. REST APIs "
        "(S3) name no operation: judge them by methods and paths.")
    copy_sources: list[str] | None = Field(
        default=None, min_length=1,
        description="For a rule that signs: the objects an x-amz-copy-source or "
        "x-amz-rename-source header may name (CopyObject, UploadPartCopy, RenameObject), as "
        "path globs over /bucket/key, matched like `paths`. Default: none, so a request "
        "naming a source is not signed by this rule.")
    substitute: list[str] = Field(
        default_factory=list, description="Secrets whose placeholders this rule swaps for values, "
        "only in the headers named by substitute_headers."
    )
    substitute_headers: list[str] | None = Field(
        default=None, min_length=1,
        description="The request headers in which `substitute` placeholders are swapped. "
        "Default: authorization, x-api-key, api-key (where the official SDKs carry keys). A "
        "placeholder anywhere else is sent as it is, so an upstream that reflects a request "
        "header never sees (or echoes) the value.",
    )
    github_app: GitHubTokenSpec | None = Field(
        default=None, description="Restricts the GitHub App installation tokens this rule "
        "injects to `repositories` and `permissions`.")
    substitute_body: bool = Field(
        default=False,
        description="Also swap the `substitute` placeholders inside the request body: inside "
        "string values of a JSON body (application/json, */*+json) and field values of a form "
        "body (application/x-www-form-urlencoded), the whole value or part of it. The body is "
        "parsed (at most 1 MiB), not string-replaced. A placeholder anywhere else in the body "
        "(an object key, a field name, another body type, a compressed or unparsable body) is "
        "refused (exfiltration), never forwarded unresolved.",
    )
    private_cidrs: list[str] = Field(
        default_factory=list, description="Non-public ranges this rule may dial."
    )
    passthrough: bool = Field(default=False, description="Tunnel without interception.")
    forward_trace_context: bool = Field(
        default=False,
        description="Forward the sandbox's W3C trace context (`traceparent`, `tracestate`) to "
        "the upstream as sent. Default: both headers are removed before forwarding (Sandgate's "
        "own span continues the sandbox's trace either way, with --otlp).",
    )
    query: dict[str, list[str] | QuerySpec | Literal["absent"]] | None = Field(
        default=None, min_length=1,
        description="Named query parameters the request must carry, each with one of the "
        "listed values, e.g. {service: [git-upload-pack]}; `{values: [...], optional: true}` "
        "for one that may be missing (and when given has one of the values), `absent` for one "
        "that must be missing (in any letter case). Values are compared exactly, after "
        "decoding %XX once. A parameter that is missing, given twice with different values, "
        "or spelled so that servers could read it differently ('+', a malformed escape, a ';' "
        "or '#' in the query, the name in other letter case) does not match. Other parameters "
        "are not constrained. Names are written as the API spells them (lower case, almost "
        "always: a capitalised name or a '+' in a value is a load error unless `exact: "
        "true` says it is meant).",
    )
    max_request_bytes: int | str | None = Field(
        default=None,
        description="The largest request body this rule lets through, e.g. 1m, 512k or 1024 "
        "(bytes). Larger bodies (declared or received) are refused with 413 too_large. The "
        "proxy's --max-request-body still applies; the smaller limit wins.",
    )
    mcp: McpSpec | None = Field(
        default=None, description="The rule carries MCP (streamable HTTP): the JSON-RPC "
        "messages of every request body are judged by method and tool (docs/mcp.md).")
    jsonrpc: JsonRpcSpec | None = Field(
        default=None, description="The rule carries generic JSON-RPC 2.0: the messages of "
        "every request body are judged by method.")
    websocket: bool | None = Field(
        default=None, description="With `mcp:`, `jsonrpc:` or `llm:` only: true lets a "
        "WebSocket be opened on the rule's URLs, and every message on it, both ways, is judged "
        "and filtered as a request body and its answer are (with `llm:`: the Responses API's "
        "WebSocket transport, each `response.create` judged by model and output cap; not "
        "with `llm.budget`). Without it such a rule refuses any protocol upgrade (403 "
        "upgrade_refused): a WebSocket would carry calls no rule judged.")
    llm: LlmSpec | None = Field(
        default=None, description="The rule carries LLM API calls: model allow-list, output "
        "cap and token/cost budget (docs/spend.md).")
    dns: DnsSpec | None = Field(
        default=None, description="The policy DNS also answers these query types for the "
        "rule's hosts (A and AAAA always are), e.g. {types: [TXT]}.")
    description: str | None = Field(
        default=None, description="Why the rule exists, for reviewers (shown by explain).")
    owner: str | None = Field(
        default=None, description="Who answers for the rule: a team, a person, an alias.")
    ticket: str | None = Field(
        default=None, description="The change request or issue that granted it (an id or URL).")
    expires: date | str | None = Field(
        default=None, description="The day the grant ends (YYYY-MM-DD): from that day on "
        "`sandgate check` fails, and `sandgate lint` warns in the week before. The proxy "
        "keeps applying the rule until it is removed.")
    lint: LintSpec | None = Field(
        default=None, description="Lint warnings on this rule that are known and accepted: "
        "{ignore: [CODE], why: ...}. Listed by `sandgate report`.")


class IdentitySpec(_Strict):
    description: str | None = Field(
        default=None, description="What the identity is for. An identity may span files; "
        "description, mode and narrower_than may each be set in one file only.")
    use: list[str] | None = Field(
        default=None, min_length=1,
        description="Templates (top-level `templates:`, in any file) whose rules this identity "
        "gets, in this order, before its own rules of this file (the first matching allow rule "
        "wins, so a template decides its requests the same way in every identity using it).",
    )
    mode: Literal["enforce", "report"] = Field(
        default="enforce",
        description="enforce (default): refuse what the rules do not allow. report: a request "
        "(or CONNECT) the rules would refuse (no_rule, denied_by_rule) is forwarded WITHOUT "
        "any credential injected or placeholder swapped, and audited with decision `report` and "
        "the code it would have had. Never relaxed in report mode: authentication and unknown "
        "identities, internal/self addresses (checked without any private_cidrs), "
        "exfiltration, TLS, wire syntax, body size and injection safety.",
    )
    narrower_than: str | None = Field(
        default=None,
        description="Another identity this one must be narrower than. `sandgate check` proves "
        "that every request this identity may make, the other may make too, with at least the "
        "secrets this one gets on it, and every passthrough tunnel it gets, the other gets; "
        "otherwise it prints a counter-example request.",
    )
    limits: LimitsSpec | None = Field(
        default=None, description="Rate and connection limits of this identity (set in one "
        "of its files only).")
    owns: list[str] | None = Field(
        default=None, min_length=1,
        description="The policy files (names in the policy directory, e.g. 20-agent.yaml) that "
        "may add rules to this identity, its own rules or `use:` of templates; the file that "
        "sets `owns` always may. A rule from any other file is a load error, so a drive-by "
        "file cannot widen the identity. Set in one of its files only.")
    rules: list[RuleSpec] = Field(
        default_factory=list,
        description="The identity's rules, in order. Several files may add rules to one "
        "identity: files are read in name order, rules keep their order within a file; rule "
        "names are unique per identity across files and templates.")


class TestSpec(_Strict):
    """A fixture, run by `sandgate check` through the proxy's own decision and address step."""

    __test__ = False  # not a pytest class

    identity: str = Field(description="The identity making the request.")
    request: str | None = Field(
        default=None,
        description="'METHOD URL', e.g. 'GET https://pypi.org/simple/', judged as the proxy "
        "judges a request; or 'CONNECT host:port', judged as the proxy judges a tunnel "
        "(passthrough or intercepted) before any request inside it. Required unless `dns`.")
    dns: str | None = Field(
        default=None, description="Instead of `request`: a name looked up through the policy "
        "DNS (`sandgate run --dns`), with expect: resolve or refuse.")
    type: str | None = Field(
        default=None, description="With `dns`: the query type (default A), e.g. AAAA, TXT.")
    expect: Literal["allow", "deny", "tunnel", "ask", "resolve", "refuse"] = Field(
        description="What the proxy does: allow (inspected and forwarded), deny (refused), "
        "ask (an `action: ask` rule holds it for approval), or "
        "tunnel (an https request to a host:port a `passthrough` rule tunnels: forwarded "
        "uninspected, whatever its method, path or query; a `CONNECT` fixture may say allow "
        "with `passthrough: true` instead). A request to an IP literal, or to a name given to "
        "`check --resolve HOST=IP`, also passes the address step: a non-public address outside "
        "the rule's private_cidrs is refused. A `dns` fixture: resolve (the policy DNS answers "
        "the name) or refuse (NXDOMAIN or REFUSED, never asked upstream).")
    rule: str | None = Field(
        default=None, description="The rule that decides: the allowing rule (the first "
        "matching allow rule of the identity), or the deny rule that refuses.")
    inject: list[str] | Literal["none"] | None = Field(
        default=None, description="The secrets the proxy injects or substitutes on this "
        "request (the allowing rule's secrets, compared as a set), or `none`: e.g. "
        "`inject: none` on a package-index request proves no token goes there. An entry is a "
        "secret name, or the form `sandgate explain` prints for a brokered credential, e.g. "
        "`gh-app(repo=acme/api, contents=read)` or `aws(service=s3, region=eu-west-1)` "
        "(whitespace and the order of key=value pairs do not matter), which must equal the "
        "form of what the proxy would inject.")
    code: Literal["no_rule", "denied_by_rule", "internal_address",
                  "sandbox_required", "upgrade_refused", "model_not_allowed",
                  "max_tokens_over_cap"] | None = Field(
        default=None, description="For expect: deny, why: no_rule (nothing allows it), "
        "denied_by_rule (a deny rule matches), internal_address (allowed, but the address "
        "is non-public and not in private_cidrs; known for IP literals and --resolve names), "
        "sandbox_required (the allowing rule binds a per-sandbox secret and the fixture gives "
        "no `sandbox:`), upgrade_refused (a `websocket: true` fixture on a rule with mcp:/"
        "jsonrpc:/llm: that does not say `websocket: true`), model_not_allowed and "
        "max_tokens_over_cap (a `model:` fixture on a rule with `llm:`).")
    model: str | None = Field(
        default=None, description="The request is an LLM call (POST) asking for this model: "
        "judged by the rules' `llm:` as the proxy judges the body. With `websocket: true` (a "
        "GET): a `response.create` of this model sent on the Responses API's WebSocket.")
    max_tokens: int | None = Field(
        default=None, description="With `model`: the output cap the call asks for (default: "
        "none).")
    sandbox: str | None = Field(
        default=None, description="The caller's sandbox id (as in its token or Docker label). "
        "Without it the caller has none: a rule binding a per-sandbox secret (a "
        "`{{ sandbox }}` path, a dynamic secret) refuses it with sandbox_required, as the "
        "proxy does.")
    gateway: bool = Field(
        default=False, description="The request's URL is a gateway path (e.g. `POST "
        "/anthropic/v1/messages`): mapped by `gateways:` and judged as the gateway listener "
        "judges it (no CONNECT, so passthrough never applies).")
    passthrough: bool | None = Field(
        default=None, description="For `CONNECT host:port` fixtures: true when the tunnel is "
        "passed through without interception (no request inside is judged), false when it is "
        "intercepted and each request inside is judged again.")
    mcp: CallTestSpec | None = Field(
        default=None, description="The request carries this MCP call, e.g. {tool: "
        "delete_repo}: judged by the rules' `mcp:` as the proxy judges the body.")
    jsonrpc: CallTestSpec | None = Field(
        default=None, description="The request carries this JSON-RPC call ({method: NAME}).")
    websocket: bool = Field(
        default=False, description="The request (a GET) opens a WebSocket: a rule with "
        "`mcp:`/`jsonrpc:`/`llm:` refuses it (upgrade_refused) unless the rule says "
        "`websocket: true`. With `mcp:`/`jsonrpc:`/`model:` in the fixture, the call is a "
        "message sent on that WebSocket, judged as the proxy judges each message.")
    headers: dict[str, str] | None = Field(
        default=None, min_length=1,
        description="Request headers, e.g. {x-amz-copy-source: /private-data/payroll.csv} or "
        "{x-amz-target: DynamoDB_20120810.GetItem}: a rule that signs (`inject: {sign}`) "
        "judges the ones a SigV4 signature covers, as the proxy does. (An Action goes in the "
        "URL's query: a form body's Action is judged the same way.)")


class CallTestSpec(_Strict):
    """The JSON-RPC call a fixture's request carries (judged as the proxy judges its body)."""

    tool: str | None = Field(default=None, description="A tools/call of this tool.")
    arguments: dict[str, str | int | float | bool | None] | None = Field(
        default=None, description="The tool's arguments (default: none).")
    method: str | None = Field(default=None, description="A request of this method instead "
                               "of a tools/call (e.g. prompts/get with `name`).")
    name: str | None = Field(default=None, description="With `method`: the prompt name or "
                             "resource uri it names.")


class GatewaySpec(_Strict):
    """A base-URL gateway entry, served by `sandgate run --gateway HOST:PORT`."""

    prefix: str = Field(
        description="The path prefix a sandbox puts in its SDK's base URL, e.g. /anthropic "
        "(base URL http://sandgate:PORT/anthropic). One or more segments of letters, digits, "
        "'.', '_', '~' and '-'; unique, and no prefix may be a whole-segment prefix of another.")
    upstream: str = Field(
        description="Where requests under the prefix go: https://HOST or https://HOST:PORT, "
        "without a path (the path after the prefix is the upstream path, judged by the caller "
        "identity's rules exactly as a proxied request to that host). Always dialled with "
        "TLS verified.")
    token_header: str | list[str] = Field(
        description="The request header in which the sandbox's SDK carries its API key, and so "
        "its Sandgate token: x-api-key, authorization (`Bearer ` is accepted), api-key, or any "
        "other header name; or a list of them when SDK versions differ (newer Anthropic SDKs "
        "send authorization, older ones x-api-key): exactly one of them must carry the token. "
        "Sandgate reads the identity from it and removes it; the allowing rule's injection "
        "then sets the real key.")


class PolicyFile(_Strict):
    version: Literal["v1"]
    # null (an empty `secrets:` key, an identity written without rules) is what the loader
    # reads as empty; the JSON Schema says so too, so editors accept what `sandgate check` does.
    secrets: dict[str, SecretSpec] | None = Field(default_factory=dict)
    templates: dict[str, list[RuleSpec]] = Field(
        default_factory=dict,
        description="Named lists of rules that identities add with `use: [NAME, ...]`. A "
        "template's rules may inject secrets (declared under `secrets:` as usual); they are "
        "checked once, where the template is written, and each rule keeps its own source "
        "(file:line) in the audit. Templates cannot use templates.",
    )
    identities: dict[str, IdentitySpec | None] | None = Field(default_factory=dict)
    tests: list[TestSpec] | None = Field(default_factory=list)
    gateways: list[GatewaySpec] | None = Field(
        default_factory=list,
        description="Base-URL gateway entries for clients that cannot use a proxy or trust a "
        "CA (`sandgate run --gateway HOST:PORT`). Prefixes are unique across files.")
    webhooks: dict[str, WebhookSpec] | None = Field(
        default_factory=dict, description="Named receivers of approval requests (an `action: "
        "ask` rule's `approval.webhook`), sent by Sandgate itself. Names are unique across "
        "files.")
    budgets: dict[str, BudgetDefSpec] | None = Field(
        default_factory=dict, description="Named token and cost budgets, each shared by the "
        "rules whose `llm.budget` names it. Names are unique across files.")
    prices: list[PriceSpec] | None = Field(
        default_factory=list, description="Model prices that win over the shipped table "
        "(first match wins).")
