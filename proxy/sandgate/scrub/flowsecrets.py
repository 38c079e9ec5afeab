"""The flow owns its secrets: the scrub set of one flow is what Sandgate holds now plus every
value that was injected into that flow, whatever the cache did since.

The shared set (`ScrubSets.current`) is compiled from the broker's values when they change:
the cache, the leases, the minted tokens with the client secrets and private keys they are
minted with, the retired values (`sandgate.secrets.retired`), the canaries and Sandgate's own
keys (the audit signing key). It
follows the cache, so on its own it can lose a value while a request carrying it is still in
flight: Vault rotates the secret and another request refreshes the cache, the sandbox ends
(token expiry, `DELETE /v1/sandboxes/{id}`), a reload drops the secret. The retired window
catches these for a while; a flow must not depend on a window, so what was injected into it is
recorded on its `FlowRecord` (`Owned`, built by `owned`) and always scrubbed from its response,
its trailers, its WebSocket frames and its refusals, in every encoding.

When the flow's values are all in the shared set (the usual case) the shared automaton is used
as it is; otherwise a union is compiled once and kept in a small cache keyed by the shared
set's version and the flow's values, so a long stream costs one compilation, not one per chunk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sandgate.inject import own_forms
from sandgate.policy.model import Policy
from sandgate.scrub.scrubber import SecretSet

# Unions compiled for flows whose values left the shared set; a handful is plenty (only flows
# in flight across a rotation, a sandbox end or a reload need one).
_UNIONS_KEPT = 32


@dataclass(frozen=True)
class Owned:
    """What was injected into one flow: (name, value) pairs and Sandgate's own encodings of
    them (a Basic pair, a query value's escapes). Never printed: the fields are not in repr."""

    pairs: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    forms: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)

    def __bool__(self) -> bool:
        return bool(self.pairs or self.forms)


def owned(policy: Policy, values: Mapping[str, str], names: frozenset[str]) -> Owned:
    """The record of an injection of `values` (name -> value, "name.username" included) for
    the secrets `names`, under the policy the flow was judged by."""
    pairs = tuple((n, values[n]) for n in sorted(names) if n in values)
    forms = tuple((n, form) for n, fs in sorted(own_forms(policy, values).items())
                  for form in fs)
    return Owned(pairs, forms)


class Broker(Protocol):
    """What the scrub sets read from the secret broker (sandgate.secrets.vault.SecretBroker)."""

    @property
    def generation(self) -> int: ...
    def cached_pairs(self) -> list[tuple[str, str | bytes]]: ...
    def value_views(self) -> list[dict[str, str]]: ...


class ScrubSets:
    """The shared scrub set, rebuilt when the broker's values change, and per-flow unions."""

    def __init__(self) -> None:
        self._shared = SecretSet({})
        self._generation = -1
        self._version = 0  # bumps with every rebuild: keys the unions
        self._pairs: list[tuple[str, str | bytes]] = []
        self._extra: dict[str, list[bytes]] = {}
        self._have_pairs: frozenset[tuple[str, str | bytes]] = frozenset()
        self._have_forms: frozenset[bytes] = frozenset()
        self._unions: OrderedDict[tuple[int, Owned], SecretSet] = OrderedDict()

    def invalidate(self) -> None:
        """Rebuild at the next use (a reload: the policy's own forms and the canaries)."""
        self._generation = -1

    def current(self, broker: Broker, canaries: Mapping[str, str], policy: Policy,
                own: Sequence[tuple[str, str | bytes]] = ()) -> SecretSet:
        """Every value the broker holds or retired, every canary, Sandgate's own credentials
        (`own`: the audit signing key) and Sandgate's own encodings of them, compiled once per
        change of the broker's values (`own` is fixed for the process)."""
        if broker.generation != self._generation:
            generation = broker.generation
            # Every value of every sandbox: a sandbox must not receive another's value either.
            pairs = [*canaries.items(), *own, *broker.cached_pairs()]
            extra: dict[str, list[bytes]] = {}
            for view in broker.value_views():  # one caller's values together (a Basic pair)
                for name, forms in own_forms(policy, view).items():
                    extra.setdefault(name, []).extend(forms)
            self._shared = SecretSet(pairs, extra)
            self._pairs, self._extra = pairs, extra
            self._have_pairs = frozenset(pairs)
            self._have_forms = frozenset(f for fs in extra.values() for f in fs)
            self._generation = generation
            self._version += 1
            self._unions.clear()
        return self._shared

    def for_flow(self, broker: Broker, canaries: Mapping[str, str], policy: Policy,
                 mine: Owned | None, own: Sequence[tuple[str, str | bytes]] = ()) -> SecretSet:
        """The shared set, plus every value injected into the flow (`mine`)."""
        shared = self.current(broker, canaries, policy, own)
        if not mine or (self._have_pairs.issuperset(mine.pairs)
                        and self._have_forms.issuperset(f for _, f in mine.forms)):
            return shared
        key = (self._version, mine)
        union = self._unions.get(key)
        if union is None:
            extra = {name: list(forms) for name, forms in self._extra.items()}
            for name, form in mine.forms:
                extra.setdefault(name, []).append(form)
            union = self._unions[key] = SecretSet([*mine.pairs, *self._pairs], extra)
            if len(self._unions) > _UNIONS_KEPT:
                self._unions.popitem(last=False)
        else:
            self._unions.move_to_end(key)
        return union
