"""Validate OCSF events against the vendored OCSF 1.8.0 JSON Schema (tests/support/ocsf/).

Neither OCSF Python library validates events offline (py-ocsf-models has models for the
finding classes only; ocsf-lib compiles and compares schemas), so the schema of the classes
Sandgate uses was generated from the OCSF schema repository at its 1.8.0 release by
scripts/ocsf-jsonschema.py and is validated with jsonschema. Licence: tests/support/ocsf/LICENSE
(Apache-2.0) and NOTICE.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = Path(__file__).parent / "ocsf" / "ocsf-1.8.0.schema.json"


@functools.cache
def _defs() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text())


@functools.cache
def _validator(class_uid: int) -> jsonschema.Draft202012Validator:
    root = _defs()
    key = f"class_{class_uid}"
    if key not in root["$defs"]:
        raise AssertionError(f"class {class_uid} is not in the vendored OCSF schema")
    schema = {"$defs": root["$defs"], "$ref": f"#/$defs/{key}"}
    return jsonschema.Draft202012Validator(schema)


def ocsf_version() -> str:
    return str(_defs()["ocsf_version"])


def problems(event: dict[str, Any]) -> list[str]:
    """Every way `event` breaks the OCSF schema of its class (empty: valid)."""
    uid = event.get("class_uid")
    if not isinstance(uid, int):
        return ["no integer class_uid"]
    out = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
           for e in _validator(uid).iter_errors(event)]
    if event.get("type_uid") != uid * 100 + event.get("activity_id", -1):
        out.append("type_uid is not class_uid * 100 + activity_id")
    return out


def check(event: dict[str, Any]) -> None:
    errs = problems(event)
    assert not errs, f"OCSF {ocsf_version()} class {event.get('class_uid')}: " + "; ".join(errs)
