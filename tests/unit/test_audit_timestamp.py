"""The audit line's time: ISO 8601 UTC, milliseconds, what datetime.isoformat wrote."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.audit import events as audit

pytestmark = pytest.mark.unit


@given(st.integers(min_value=0, max_value=4_102_444_800_000_000))  # microseconds to 2100
def test_timestamp_is_what_isoformat_writes(us: int) -> None:
    now = us / 1_000_000
    want = datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")
    saved = audit.time.time
    try:
        audit.time.time = lambda: now  # type: ignore[assignment]
        got = audit._timestamp()
    finally:
        audit.time.time = saved  # type: ignore[assignment]
    assert len(got) == len(want) == 24 and got.endswith("Z")
    # datetime rounds the float to microseconds before truncating to milliseconds: within 1 ms
    delta = datetime.fromisoformat(got) - datetime.fromisoformat(want)
    assert abs(delta.total_seconds()) <= 0.001


def test_timestamp_follows_the_clock_across_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([1_700_000_000.5, 1_700_000_000.9994, 1_700_000_001.0, 1_700_000_061.25])
    monkeypatch.setattr(audit.time, "time", lambda: next(clock))
    assert [audit._timestamp() for _ in range(4)] == [
        "2023-11-14T22:13:20.500Z", "2023-11-14T22:13:20.999Z", "2023-11-14T22:13:21.000Z",
        "2023-11-14T22:14:21.250Z"]
