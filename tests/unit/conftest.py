"""tests/unit: selects the hypothesis profile for the property-based tests.

``SANDGATE_FUZZ=long`` runs every property with 20x the examples; unset (or ``ci``) keeps the
short CI budget. See tests/unit/fuzz.py.
"""

from __future__ import annotations

from tests.unit import fuzz

fuzz.load()
