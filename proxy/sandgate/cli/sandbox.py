"""`sandgate sandbox`: Docker sandboxes (sandgate.sandbox.cli), if the docker extra is there."""

from __future__ import annotations

import argparse
from typing import Any

from sandgate.cli.common import confdir_arg


def register(sub: Any) -> None:
    try:
        from sandgate.sandbox import cli as sandbox_cli
    except ImportError as e:  # the docker extra is not installed: say so when it is asked for
        missing = sub.add_parser("sandbox", help="Docker sandboxes (needs sandgate[docker])")
        missing.set_defaults(missing_extra=f"{e}; install it with: pip install 'sandgate[docker]'")
        missing.add_argument("rest", nargs=argparse.REMAINDER)
    else:
        sandbox_cli.add_parser(sub, confdir_arg)
        sub.choices["sandbox"].set_defaults(handler=sandbox_cli.run)
