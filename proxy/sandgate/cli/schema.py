"""`sandgate schema`: the policy format as JSON Schema (editors, CI and the docs read it)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    sub.add_parser("schema", help="print the JSON Schema of the policy format").set_defaults(
        handler=cmd_schema)


def cmd_schema(args: argparse.Namespace) -> int:
    from sandgate.policy.loader import policy_json_schema

    print(json.dumps(policy_json_schema(), indent=2))
    return 0
