#!/usr/bin/env python3
"""Write the JSON Schema that tests validate Sandgate's OCSF events against.

Neither OCSF Python library validates events offline (py-ocsf-models models only the finding
classes; ocsf-lib compiles and compares schemas but has no event validator), so the tests use
jsonschema with this file, vendored in tests/support/ocsf/ with the schema's version and licence.

How it was made (ocsf-lib installed in a scratch venv, the ocsf/ocsf-schema repository checked
out at its 1.8.0 release commit 3dcb905d):

    python -m ocsf.compile ocsf-schema --ignore-extension linux windows macos > compiled.json
    scripts/ocsf-jsonschema.py compiled.json tests/support/ocsf/ocsf-1.8.0.schema.json

Strict where OCSF is: no attribute a class or object does not define (`additionalProperties:
false`; `unmapped` takes anything), required attributes present (those of profiles only when
the profile's attribute is given), enumerated `*_id` values from the enum, `at_least_one`
constraints, integer/number/string/boolean types and the types' value patterns.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

# The classes sandgate.audit.ocsf maps events to.
CLASSES = ("http_activity", "network_activity", "dns_activity", "authentication",
           "api_activity", "event_log_actvity", "application_lifecycle")

_BASE = {"string_t": "string", "integer_t": "integer", "long_t": "integer",
         "float_t": "number", "boolean_t": "boolean", "timestamp_t": "integer"}


def _type(schema: dict[str, Any], name: str) -> dict[str, Any]:
    if name == "json_t":
        return {}
    if name == "object":
        return {"type": "object"}
    if name in schema["objects"]:
        return {"$ref": f"#/$defs/{name}"}
    if name in _BASE:
        return {"type": _BASE[name]}
    t = schema["types"][name]
    out = _type(schema, t["type"]) if t.get("type") else {"type": "string"}
    if t.get("regex"):
        try:
            re.compile(t["regex"])
            out["pattern"] = t["regex"]
        except re.error:
            pass
    if t.get("range"):
        out["minimum"], out["maximum"] = t["range"]
    if t.get("max_len"):
        out["maxLength"] = t["max_len"]
    return out


def _attrs(schema: dict[str, Any], attrs: dict[str, Any], constraints: Any,
           used: set[str]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required: list[str] = []
    for name, a in attrs.items():
        t = a["type"]
        if t in schema["objects"]:
            used.add(t)
        item = _type(schema, t)
        enum = a.get("enum")
        if enum and t in ("integer_t", "long_t"):
            item["enum"] = sorted(int(k) for k in enum)
        props[name] = {"type": "array", "items": item} if a.get("is_array") else item
        if a.get("requirement") == "required" and not a.get("profile"):
            required.append(name)
    out: dict[str, Any] = {"type": "object", "properties": props,
                           "additionalProperties": False}
    if required:
        out["required"] = sorted(required)
    if constraints and constraints.get("at_least_one"):
        out["anyOf"] = [{"required": [n]} for n in constraints["at_least_one"]]
    if constraints and constraints.get("just_one"):
        out["oneOf"] = [{"required": [n]} for n in constraints["just_one"]]
    return out


def build(schema: dict[str, Any]) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    used: set[str] = set()
    for name in CLASSES:
        c = schema["classes"][name]
        d = _attrs(schema, c["attributes"], c.get("constraints"), used)
        d["properties"]["class_uid"]["const"] = c["uid"]
        defs[f"class_{c['uid']}"] = d
    done: set[str] = set()
    while used - done:
        name = sorted(used - done)[0]
        done.add(name)
        o = schema["objects"][name]
        defs[name] = _attrs(schema, o["attributes"], o.get("constraints"), used)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$comment": f"OCSF {schema['version']} (Apache-2.0, github.com/ocsf/ocsf-schema), "
                        "classes " + ", ".join(CLASSES) + "; made by scripts/ocsf-jsonschema.py",
            "ocsf_version": schema["version"],
            "$defs": dict(sorted(defs.items()))}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: ocsf-jsonschema.py COMPILED.json OUT.json", file=sys.stderr)
        return 2
    schema = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(build(schema), indent=1, sort_keys=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
