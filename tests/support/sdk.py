"""The official SDK clients of the integration tests: the interpreter that runs them.

Since mitmproxy 12.3.1 (which takes the h11 0.16 the SDKs need; 11.0.2 refused it) the SDKs
are in the one dev environment: the `clients` extra of pyproject.toml, locked with hashes in
requirements/dev.lock, installed by scripts/setup.sh. A client still runs as its own process
(the test run's interpreter), as an agent host's would, talking to Sandgate only over the
network.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

CLIENT_PY = Path(sys.executable)


def need_sdk(*modules: str) -> None:
    """Fail (never skip) when a client module is missing from the environment."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    assert not missing, (
        f"{', '.join(missing)} not installed in {sys.prefix}: run scripts/setup.sh (the SDKs are "
        "in requirements/dev.lock, the `clients` extra)"
    )
