"""What a request Sandgate signs with SigV4 asks for beyond its method, host, path and query.

A signature vouches for every header and query parameter it covers, and AWS acts on some of
them: `X-Amz-Target` (JSON protocol) and `Action=` (query protocol, in the query or a form
body) select the operation; `x-amz-copy-source` and `x-amz-rename-source` name a second object
the request reads (or moves) with the signer's rights. A rule that judged only the host, method
and path must not sign those as sent, so a signing rule judges them too (sandgate.decision).

What happens to each on a signing rule (docs/credentials.md has the same as a table):

- Authorization, X-Amz-Date, X-Amz-Content-SHA256, X-Amz-Security-Token: removed; Sandgate's.
- X-Amz-Target, Action (query or form body): the operation, judged by `operations:`.
- x-amz-copy-source, x-amz-rename-source: a second object, refused unless `copy_sources:`
  admits it; x-amz-copy-source-*, x-amz-rename-source-*, x-amz-source-expected-bucket-owner
  qualify that source: signed with it, refused without one.
- UNJUDGED_RESOURCES (a KMS key id, S3 Control's account id...): refused.
- CONTENT_HEADERS and CONTENT_PREFIXES (metadata, ACL, checksums...): signed as sent.
- any other x-amz-* header: not judged, refused (AWS would act on it, S3 rejects it unsigned).
- a presigned URL's query parameters (X-Amz-*, SigV2's AWSAccessKeyId, Signature...): refused.
- Host, Content-Type, Content-MD5: signed as sent; any other header: forwarded, not signed.
- a path with `.`, `..` or empty segments: refused (judged resolved, signed and read as sent).

`parse` is pure and never raises; `misfit` says why a rule does not sign a request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sandgate.policy.model import Rule, glob_matches
from sandgate.policy.paths import normalise_path
from sandgate.secrets.body import body_kind
from sandgate.text import has_control_chars, percent_decode

# What the client may have sent to sign itself: replaced by Sandgate's.
SIGNING_HEADERS = ("authorization", "x-amz-date", "x-amz-content-sha256",
                   "x-amz-security-token")
OPERATION_HEADER = "x-amz-target"
# Headers naming a second object the request reads (CopyObject, UploadPartCopy) or moves
# (RenameObject), as /bucket/key.
SOURCE_HEADERS = ("x-amz-copy-source", "x-amz-rename-source")
_QUALIFIER_PREFIXES = ("x-amz-copy-source-", "x-amz-rename-source-")
_QUALIFIERS = frozenset({"x-amz-source-expected-bucket-owner"})
# Headers naming a resource that no rule key judges: refused, whatever the rule says.
UNJUDGED_RESOURCES = {
    "x-amz-server-side-encryption-aws-kms-key-id": "names a KMS key the signer's rights would "
    "use",
    "x-amz-account-id": "names the account an S3 Control request acts on",
    "x-amz-outpost-id": "names an S3 on Outposts resource",
    "x-amz-request-route": "routes the body into another request's answer (Object Lambda)",
    "x-amz-request-token": "routes the body into another request's answer (Object Lambda)",
}
# x-amz-* headers that are part of the judged request (what is written, or how it is
# answered), never a second resource: signed as sent.
CONTENT_HEADERS = frozenset({
    "x-amz-acl", "x-amz-storage-class", "x-amz-tagging", "x-amz-tagging-directive",
    "x-amz-metadata-directive", "x-amz-website-redirect-location", "x-amz-request-payer",
    "x-amz-expected-bucket-owner", "x-amz-sdk-checksum-algorithm", "x-amz-checksum-mode",
    "x-amz-bypass-governance-retention", "x-amz-mfa", "x-amz-write-offset-bytes",
    "x-amz-bucket-object-lock-enabled", "x-amz-object-ownership", "x-amz-object-attributes",
    "x-amz-optional-object-attributes", "x-amz-max-parts", "x-amz-part-number-marker",
    "x-amz-confirm-remove-self-bucket-access", "x-amz-user-agent", "x-amz-api-version",
    "x-amz-invocation-type", "x-amz-log-type", "x-amz-client-context",
    "x-amz-glacier-version", "x-amz-sha256-tree-hash", "x-amz-archive-description",
    "x-amz-mp-object-size", "x-amz-transition-default-minimum-object-size",
    "x-amz-skip-destination-validation",
})
CONTENT_PREFIXES = ("x-amz-meta-", "x-amz-grant-", "x-amz-checksum-", "x-amz-object-lock-",
                    "x-amz-server-side-encryption", "x-amz-if-")
SIGNED_AS_SENT = ("host", "content-type", "content-md5")


@dataclass(frozen=True, slots=True)
class AwsParts:
    """What a signing rule judges of a request besides its method, host, path and query."""

    operation: str | None = None  # X-Amz-Target's or Action's value; None: it names none
    operation_from: str | None = None  # "X-Amz-Target", "Action in the query", ...
    sources: tuple[tuple[str, str], ...] = ()  # (header, normalised /bucket/key)
    refusal: str | None = None  # why no rule may sign it (a sentence), whatever the rule says
    hint: str | None = None  # the fix for `refusal`


def _content(name: str) -> bool:
    return (name in CONTENT_HEADERS or name.startswith(CONTENT_PREFIXES)) \
        and name not in UNJUDGED_RESOURCES


def _qualifier(name: str) -> bool:
    return name in _QUALIFIERS or name.startswith(_QUALIFIER_PREFIXES)


def signed_header(name: str) -> bool:
    """Does the signature cover this (lower-case) header? Only what a signing rule judges:
    the operation, admitted sources and their qualifiers, content headers, Host,
    Content-Type, Content-MD5 (the signing headers are Sandgate's own, added by the signer)."""
    return (name in SIGNED_AS_SENT or name == OPERATION_HEADER or name in SOURCE_HEADERS
            or _qualifier(name) or _content(name))


def source_path(value: str) -> str | None:
    """`bucket/key` or `/bucket/key` (%-encoded, optionally `?versionId=...`) as the
    normalised path `paths:` globs match; None when it is not one unambiguous path (an access
    point ARN, another query, a malformed escape, a '+', `.`, `..` or empty segments)."""
    raw, _, version = value.strip().partition("?")
    if version and not (version.startswith("versionId=") and "&" not in version):
        return None
    if not raw or raw.startswith("arn:") or "+" in raw:  # '+': a space to some decoders
        return None
    raw = raw if raw.startswith("/") else "/" + raw
    try:
        decoded = percent_decode(raw, "copy source")
        path = normalise_path(raw)
    except ValueError:
        return None
    if has_control_chars(decoded) or path != decoded or path.count("/") < 2:
        return None
    return path


# SigV2 query authentication (an S3 presigned URL of the older kind, query APIs' signature
# parameters): a second signature too.
_SIGV2_QUERY = frozenset({"awsaccesskeyid", "signature", "signatureversion", "signaturemethod"})


def presigned_names(query: Iterable[tuple[str, str]]) -> list[str]:
    """The query parameters that carry a signature of the client's own, in any letter case:
    X-Amz-* (a SigV4 presigned URL's signature, credential, date, expiry, signed headers,
    token, or a header given as a parameter) and SigV2's AWSAccessKeyId, Signature,
    SignatureVersion, SignatureMethod."""
    return sorted({n for n, _ in query
                   if n.casefold().startswith("x-amz-") or n.casefold() in _SIGV2_QUERY})


def _refused(why: str, hint: str) -> AwsParts:
    return AwsParts(refusal=why, hint=hint)


def _form_actions(body: bytes) -> list[tuple[str, str]] | None:
    """(name, value) of the form fields named Action in any letter case; None when a field
    cannot be decoded unambiguously (it could be an Action)."""
    out: list[tuple[str, str]] = []
    for field in body.split(b"&"):
        name, _, value = field.partition(b"=")
        try:
            dn, dv = (percent_decode(x.decode("utf-8").replace("+", " "), "form field")
                      for x in (name, value))
        except (UnicodeDecodeError, ValueError):
            return None
        if dn.casefold() == "action":
            out.append((dn, dv))
    return out


def path_as_judged(path: str) -> bool:
    """Is the raw request path, %-decoded once as S3 decodes it, the path the rules judged
    (sandgate.policy.paths.normalise_path)? Not with `.` or `..` segments, `//` or a
    backslash: the decision resolves them, S3 does not (`/other-bucket/..%2Fmine/x` is judged
    as /mine/x and writes the key `../mine/x` into other-bucket)."""
    raw = path.split("?", 1)[0]
    try:
        return percent_decode(raw, "path") == normalise_path(raw)
    except ValueError:
        return False


def parse(headers: Iterable[tuple[str, str]], query: tuple[tuple[str, str], ...] | None,
          body: bytes | None = None, content_type: str | None = None,
          encoded: bool = False, path: str | None = None) -> AwsParts:
    """The parts of a request a signing rule judges. `headers`: (name, value) as sent;
    `query`: sandgate.request.parse_query's reading (None: unreadable); `body`: the complete
    body (None: not read, e.g. `sandgate explain`); `encoded`: the body has a
    content-encoding; `path`: the raw request path (None: not checked). Never raises."""
    if path is not None and not path_as_judged(path):
        return _refused("its path has '.', '..' or empty segments or a backslash (maybe "
                        "%-escaped), which the rules resolve and AWS does not, so what would "
                        "be signed is not the path judged",
                        "send the path as the object's plain /bucket/key")
    if query is None:
        return _refused("its query cannot be read unambiguously (a ';', '#', '+' or a malformed "
                        "%-escape), so Sandgate cannot judge what it would sign",
                        "encode spaces as %20 and send each parameter once")
    presigned = presigned_names(query)
    if presigned:
        return _refused(f"its query carries {', '.join(presigned)}: a presigned URL's "
                        "signature, which Sandgate does not pass on beside its own",
                        "send the request without its own signature parameters (X-Amz-*, "
                        "AWSAccessKeyId, Signature): Sandgate signs it")
    ops: list[tuple[str, str]] = []
    sources: list[tuple[str, str]] = []
    qualifiers: list[str] = []
    for raw_name, value in headers:
        name = raw_name.lower()
        if name in SIGNING_HEADERS or not name.startswith("x-amz-"):
            continue
        if name == OPERATION_HEADER:
            ops.append(("X-Amz-Target", value.strip()))
        elif name in SOURCE_HEADERS:
            if any(h == name for h, _ in sources):
                return _refused(f"it gives the {name} header more than once",
                                f"name one source in one {name} header")
            path = source_path(value)
            if path is None:
                return _refused(f"its {name} header is not a plain /bucket/key (an access "
                                "point ARN, a query other than versionId, a malformed "
                                "%-escape, a '+', or '.', '..' or empty segments)",
                                f"name the source in {name} as /bucket/key")
            sources.append((name, path))
        elif name in UNJUDGED_RESOURCES:
            kms = " (for encryption, rely on the bucket's default key)" if "kms" in name else ""
            return _refused(f"its {name} header {UNJUDGED_RESOURCES[name]}, which no rule "
                            "judges", f"send the request without {name}{kms}")
        elif _qualifier(name):
            qualifiers.append(name)
        elif not _content(name):
            return _refused(f"its {name} header is not one Sandgate judges, so it will not "
                            "sign it", f"send the request without {name}")
    if qualifiers and not sources:
        return _refused(f"its {qualifiers[0]} header qualifies a copy source the request "
                        "does not name", f"send the request without {qualifiers[0]}")
    ops += [(f"{n} in the query", v) for n, v in query if n.casefold() == "action"]
    if body and body_kind(content_type) == "form":
        actions = None if encoded else _form_actions(body)
        if actions is None:
            return _refused("its form body's Action cannot be read (a compressed body or a "
                            "malformed %-escape)", "send the form body uncompressed")
        ops += [(f"{n} in the body", v) for n, v in actions]
    if len(ops) > 1 or any(not w.startswith(("X-Amz-Target", "Action ")) for w, _ in ops):
        given = ", ".join(sorted({w for w, _ in ops}))
        return _refused(f"it names its operation more than once, or spelled so that AWS could "
                        f"read it otherwise ({given})",
                        "name the operation once: X-Amz-Target, or Action in the query or "
                        "the form body")
    op, where = (ops[0][1], ops[0][0]) if ops else (None, None)
    return AwsParts(operation=op, operation_from=where, sources=tuple(sources))


def misfit(rule: Rule, parts: AwsParts) -> tuple[str, str] | None:
    """None when the signing `rule` signs a request with these parts; else (why, the fix).
    `why` completes "rule 'NAME' ..." ."""
    if parts.refusal is not None:
        return f"signs with SigV4 and will not sign this request: {parts.refusal}", \
            parts.hint or "send the request without it"
    ops = rule.operations
    if ops is not None:
        if parts.operation is None:
            return ("lists the `operations:` it signs and this request names none "
                    "(X-Amz-Target, or Action in the query or form body)",
                    f"rule '{rule.name}' signs only requests naming one of its operations; "
                    "REST APIs such as S3 are judged by `methods:` and `paths:` instead")
        if not any(glob_matches(p, parts.operation) for p in ops):
            return (f"does not list operation {parts.operation!r} ({parts.operation_from}) in "
                    "its `operations:`",
                    f"to allow it, add {parts.operation!r} to the `operations:` of rule "
                    f"'{rule.name}'")
    for header, path in parts.sources:
        if rule.copy_sources is None or not any(p.matches(path) for p in rule.copy_sources):
            listed = ("it lists no `copy_sources:`" if rule.copy_sources is None else
                      "its `copy_sources:` do not match it")
            return (f"does not admit the {header} {path}: {listed}",
                    f"to allow reading {path} with this rule's credentials, add it (or a "
                    f"glob) to the `copy_sources:` of rule '{rule.name}'")
    return None


def signed_fields(rule: Rule, query: tuple[tuple[str, str], ...] | None,
                  headers: Iterable[tuple[str, str]]) -> dict[str, object]:
    """What `sandgate explain` shows of an allowed request a rule signs: the operation and
    sources it names, and what the rule admits of each."""
    p = parse(headers, query)
    return {
        "operation": (f"{p.operation} ({p.operation_from})" if p.operation is not None
                      else None),
        "operations": list(rule.operations) if rule.operations is not None else "any",
        "sources": [f"{h}: {path}" for h, path in p.sources],
        "copy_sources": ([x.text for x in rule.copy_sources] if rule.copy_sources is not None
                         else "none"),
        "headers": "signed: Host, Content-Type, Content-MD5, the operation, admitted sources "
                   "and content headers (x-amz-meta-*, x-amz-acl, checksums...); any other "
                   "x-amz-* header is refused, other headers are forwarded unsigned",
    }
