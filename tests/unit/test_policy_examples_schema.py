"""Every policy file in the repository is valid against `sandgate schema`'s JSON Schema.

Editors validate policy files with the JSON Schema that `sandgate schema` prints; it must accept
every example the project ships (and the loader must accept them too, so the two agree). The
YAML examples of the README and docs/ are validated, loaded and their fixtures run by
tests/unit/test_docs_examples.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).parents[2]


def _example_files() -> list[Path]:
    globs = [
        "policies/*.yaml", "policies/*.yml",
        "tests/fixtures/policies/good*/**/*.yaml", "tests/fixtures/policies/good*/**/*.yml",
        "tests/integration/policies*/*.yaml", "tests/integration/policies*/*.yml",
        "tests/compose/policies/*.yaml", "tests/compose/policies/*.yml",
    ]
    out = sorted({p for g in globs for p in ROOT.glob(g) if p.is_file()})
    assert out, "no policy examples found"
    return out


EXAMPLES: list[tuple[str, str]] = [
    (str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in _example_files()
]


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    # The schema exactly as the command prints it.
    r = subprocess.run([sys.executable, "-m", "sandgate.cli", "schema"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60, check=True)
    doc: dict[str, Any] = json.loads(r.stdout)
    jsonschema.Draft202012Validator.check_schema(doc)
    return doc


@pytest.mark.parametrize(("name", "text"), EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_example_is_valid_against_the_json_schema(schema, name, text):
    doc = yaml.safe_load(text)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc),
                    key=lambda e: list(e.absolute_path))
    assert not errors, f"{name}: " + "; ".join(
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_schema_rejects_what_the_loader_rejects_for_shape(schema):
    """The schema is not vacuous: unknown keys, wrong types and a missing version fail."""
    v = jsonschema.Draft202012Validator(schema)
    for bad in ({"identities": {}},
                {"version": "v2"},
                {"version": "v1", "bogus": 1},
                # (a rule's `hosts` may be absent in the schema: `public: true` replaces it;
                # the loader says which one is missing)
                {"version": "v1", "identities": {"a": {"rules": [{"hosts": ["x.example"]}]}}},
                {"version": "v1", "identities": {"a": {"rules": [
                    {"name": "r", "hosts": ["x.example"], "ports": ["443"]}]}}}):
        assert list(v.iter_errors(bad)), bad
