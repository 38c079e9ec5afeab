"""tests/unit: selects the hypothesis profile for the property-based tests.

``SANDGATE_FUZZ=long`` runs every property with 20x the examples; unset (or ``ci``) keeps the
short CI budget. See tests/unit/fuzz.py.
"""

from __future__ import annotations

from tests.unit import fuzz

fuzz.load()


# ------------------------------------------------------------------------------- OCSF
# Every audit event any unit test writes (gate flows, refusals, leases, tokens, reloads, limits)
# is also mapped to OCSF and validated against the OCSF 1.8.0 schema: `--audit-format ocsf`
# must take every event kind Sandgate produces (docs/audit.md).

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _every_audit_event_is_valid_ocsf(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandgate.audit.events import AuditLog
    from sandgate.audit.ocsf import to_ocsf
    from tests.support.ocsf_schema import check

    emit = AuditLog.emit

    def checked(self: AuditLog, event: str, **fields: object) -> None:
        emit(self, event, **fields)
        check(to_ocsf(self.record(event, fields)))

    monkeypatch.setattr(AuditLog, "emit", checked)
