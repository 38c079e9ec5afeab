"""Hypothesis profiles for the property-based (fuzz) tests under tests/unit.

Two profiles, chosen by the environment variable ``SANDGATE_FUZZ``:

* ``ci`` (the default): modest example counts, no deadline, no example database, so the whole
  fuzz suite stays well under a minute on two cores and leaves nothing behind.
* ``long`` (``SANDGATE_FUZZ=long``): 20 times the examples of every property, for a soak run
  before a release or after touching a parser::

      SANDGATE_FUZZ=long python -m pytest -q tests/unit/test_fuzz_*.py tests/unit/test_scrub.py

A test that needs a different budget than the profile's default asks for ``examples(n)``: n in
the ci profile, 20 * n in the long one.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

ENV = "SANDGATE_FUZZ"
CI_EXAMPLES = 100
LONG_FACTOR = 20

settings.register_profile("ci", max_examples=CI_EXAMPLES, deadline=None, database=None,
                          print_blob=True)
settings.register_profile("long", max_examples=CI_EXAMPLES * LONG_FACTOR, deadline=None,
                          database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])


def profile_name() -> str:
    name = os.environ.get(ENV, "ci").strip().lower() or "ci"
    if name not in ("ci", "long"):
        raise ValueError(f"{ENV}={name!r}: use 'ci' (default) or 'long'")
    return name


def factor() -> int:
    return LONG_FACTOR if profile_name() == "long" else 1


def examples(n: int) -> int:
    """n examples in the ci profile, LONG_FACTOR * n in the long one."""
    return n * factor()


def load() -> None:
    settings.load_profile(profile_name())
