"""The SigV4 signing scope (service, region) of a signed request, and where each part came from.

Precedence, per part: the rule's `inject: {sign: {service, region}}`, then the `aws:` secret's,
then the request's host when it is an AWS endpoint (`host_scope`). A part nothing gives is a
load error when none of the rule's hosts could give it (`hosts_may_give`), else a 503
secret_unavailable at request time: never an unsigned forward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sandgate.policy.model import AwsRef, SignRef
from sandgate.secrets.credential_form import aws_form

_REGION = re.compile(r"[a-z]{2}(?:-gov|-iso[a-z]?)?-[a-z]+-[0-9]{1,2}")
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# Partitions whose endpoints this parser knows, and the region of their global endpoints
# (iam.amazonaws.com, sts.amazonaws.com, s3.amazonaws.com sign for us-east-1; the China
# partition has no region-less endpoints).
_PARTITIONS = ((".amazonaws.com.cn", None), (".amazonaws.com", "us-east-1"))
# Endpoint labels that are not the service's signing name.
_S3_LABELS = frozenset({"s3", "s3-accesspoint", "s3-control", "s3-fips", "s3-object-lambda"})
_NOT_SERVICE = frozenset({"dualstack"})


def host_scope(host: str) -> tuple[str, str] | None:
    """(service, region) of an AWS endpoint host, or None when the host is not one this
    parser knows. Pure; never raises."""
    host = host.lower().rstrip(".")
    for suffix, global_region in _PARTITIONS:  # noqa: B007 (used after the break)
        if host.endswith(suffix):
            labels = host[: -len(suffix)].split(".")
            break
    else:
        return None
    if not all(_LABEL.fullmatch(x) for x in labels):
        return None
    if len(labels) >= 2 and _REGION.fullmatch(labels[-1]):
        region, rest = labels[-1], labels[:-1]
        while rest and rest[-1] in _NOT_SERVICE:  # s3.dualstack.eu-west-1...
            rest = rest[:-1]
        if not rest:
            return None
        svc = rest[-1].removesuffix("-fips")
        if not svc or _REGION.fullmatch(svc):
            return None
        return ("s3" if svc in _S3_LABELS else svc), region
    last = labels[-1]
    dashed = re.fullmatch(r"s3-(?:fips-)?(.+)", last)  # legacy s3-eu-west-1.amazonaws.com
    if dashed and _REGION.fullmatch(dashed.group(1)):
        return "s3", dashed.group(1)
    if global_region is None:
        return None
    if last == "s3":  # s3.amazonaws.com, BUCKET.s3.amazonaws.com
        return "s3", global_region
    if len(labels) == 1 and not _REGION.fullmatch(last):  # iam.amazonaws.com, sts...
        return last.removesuffix("-fips"), global_region
    return None


def _may_be_aws(pattern: str) -> bool:
    """Could a host this pattern (exact or `*.` wildcard) matches be an AWS endpoint?"""
    p = pattern.lower()
    if p.startswith("*."):
        base = p[1:]
        return any(base.endswith(s) or base == s for s, _ in _PARTITIONS)
    return host_scope(p) is not None


def hosts_may_give(hosts: tuple[str, ...]) -> bool:
    """Whether any of a rule's host patterns could give the scope at request time."""
    return any(_may_be_aws(h) for h in hosts)


@dataclass(frozen=True, slots=True)
class Scope:
    service: str | None
    region: str | None
    service_from: str  # "rule", "secret", "host"
    region_from: str

    @property
    def complete(self) -> bool:
        return self.service is not None and self.region is not None

    def describe(self) -> str:
        """`aws(service=s3, region=eu-west-1)` and where each came from."""
        form = aws_form(self.service or "?", self.region or "?")
        return (f"{form} [service from the {self.service_from}, "
                f"region from the {self.region_from}]")


def resolve(sign: SignRef, aws: AwsRef, host: str | None) -> Scope:
    """The scope a request to `host` is signed for (host None: statically, for a rule)."""
    from_host = host_scope(host) if host is not None else None
    parts: list[tuple[str | None, str]] = []
    for i, (ruled, secret) in enumerate(((sign.service, aws.service),
                                         (sign.region, aws.region))):
        if ruled is not None:
            parts.append((ruled, "rule"))
        elif secret is not None:
            parts.append((secret, "secret"))
        elif from_host is not None:
            parts.append((from_host[i], "host"))
        else:
            parts.append((None, "host"))
    (service, sfrom), (region, rfrom) = parts
    return Scope(service, region, sfrom, rfrom)
