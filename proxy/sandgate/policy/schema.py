"""The policy FILE FORMAT (v1), as pydantic models.

These check shape and types only (unknown keys, wrong types, missing fields). Meaning (host
globs, templates, secret references, cross-file duplicates) is checked when the loader compiles
them into sandgate.policy.model types. `sandgate schema` prints the JSON Schema of PolicyFile.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SecretSpec(_Strict):
    """Where a secret lives in Vault. Exactly one of `vault` or `mount` + `path`."""

    vault: str | None = Field(
        default=None,
        description="Full KV v2 API path, e.g. secret/data/llm/anthropic (mount 'secret').",
    )
    mount: str | None = Field(default=None, description="KV mount point, e.g. 'kv'.")
    path: str | None = Field(default=None, description="Path inside the mount.")
    field: str = Field(description="Key inside the secret's data.")
    kv_version: Literal[1, 2] = Field(default=2, description="KV engine version (mount form).")
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


class BasicSpec(_Strict):
    username: str
    password: str


class InjectSpec(_Strict):
    """Credentials added to an allowed request. Values are templates: literal text plus
    `{{ secrets.NAME }}`."""

    headers: dict[str, str] = Field(default_factory=dict)
    basic: BasicSpec | None = None
    query: dict[str, str] = Field(default_factory=dict)


class RuleSpec(_Strict):
    name: str
    action: Literal["allow", "deny"] = "allow"
    hosts: list[str] = Field(min_length=1, description="Exact hosts or '*.domain' wildcards.")
    schemes: list[Literal["https", "http"]] | None = Field(default=None, min_length=1)
    ports: list[int] | None = Field(
        default=None, min_length=1, description="Default: 443 for https, 80 for http."
    )
    methods: list[str] | None = Field(default=None, min_length=1, description="Default: any.")
    paths: list[str] | None = Field(
        default=None, min_length=1, description="Path globs; default: any path."
    )
    inject: InjectSpec | None = None
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
    private_cidrs: list[str] = Field(
        default_factory=list, description="Non-public ranges this rule may dial."
    )
    passthrough: bool = Field(default=False, description="Tunnel without interception.")


class IdentitySpec(_Strict):
    description: str | None = None
    narrower_than: str | None = Field(
        default=None,
        description="Another identity this one must be narrower than. `sandgate check` proves "
        "that every request this identity may make, the other may make too, with at least the "
        "secrets this one gets on it, and every passthrough tunnel it gets, the other gets; "
        "otherwise it prints a counter-example request.",
    )
    rules: list[RuleSpec] = Field(default_factory=list)


class TestSpec(_Strict):
    __test__ = False  # not a pytest class

    identity: str
    request: str = Field(description="'METHOD URL', e.g. 'GET https://pypi.org/simple/'.")
    expect: Literal["allow", "deny"]
    rule: str | None = None


class PolicyFile(_Strict):
    version: Literal["v1"]
    secrets: dict[str, SecretSpec] = Field(default_factory=dict)
    identities: dict[str, IdentitySpec] = Field(default_factory=dict)
    tests: list[TestSpec] = Field(default_factory=list)
