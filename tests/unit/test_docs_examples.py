"""Every shell and YAML example of the README and the documentation site does what the page says.

- YAML examples are policies: a whole one (with `version:`) is validated against `sandgate
  schema`'s JSON Schema and loaded by the real loader (several files in one block are split at
  their `# NAME.yaml` comment), and its proofs and `tests:` fixtures must pass, as `sandgate
  check` would run them. A part of one (top-level sections without `version:`, or a list of
  rules) is validated against the schema as the policy, or the template, it would be part of.
  A YAML example that is no policy at all says so: `<!-- not loaded: REASON -->`.
- Shell examples are run (bash, `set -euo pipefail`) in a scratch directory holding this
  checkout's `.venv` and `policies/`, offline; each must exit 0, or the status its
  `<!-- run: exits N -->` marker names.
- A shell example that cannot run offline in a test carries `<!-- not run: REASON -->` (or
  `<!-- not run here: REASON -->` naming the test that runs it), and the reason is required.
- Every fence names its language, so no shell example can hide in an untagged block.
(The markers are described in tests/support/docs_examples.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.support.docs_examples import REPO, SHELL, Example, all_examples, policy_files

EXAMPLES = all_examples()
YAML = [e for e in EXAMPLES if e.lang in ("yaml", "yml")
        and not (e.marker and e.marker[0] == "not loaded")]
TOP_LEVEL = {"secrets", "templates", "identities", "tests", "gateways", "webhooks", "budgets",
             "prices"}
RUN = [e for e in EXAMPLES if e.lang in SHELL and (e.marker is None or e.marker[0] == "run")]
JSON = [e for e in EXAMPLES if e.lang == "json"]


# What an unmarked shell example may run: Sandgate's own offline subcommands and plain text tools.
# Anything else (an installer, docker, curl, a server) must be marked `not run` with its reason:
# the unit lane never runs it by accident.
RUNNABLE = {*(f"sandgate {c}" for c in ("check", "lint", "explain", "schema", "token", "ca",
                                         "canary", "diff", "suggest", "report")),
            "echo", "printf", "cat", "grep", "head", "tail", "sort", "tr", "wc", "test", "diff"}


def _commands(body: str) -> list[str]:
    """What each command of a shell example runs: its first word (after `VAR=` and `$(`), and
    for `sandgate` the subcommand too (`sandgate run` serves until stopped: never unmarked)."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|\|\||;|\|", line.split(" #", 1)[0]):
            words = part.strip().lstrip("(").split()
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                first = words[0].split("=", 1)[1].lstrip("$(")
                words = ([first] if first else []) + words[1:]
            if words and not words[0].startswith("#"):
                name = words[0]
                if name.rsplit("/", 1)[-1] == "sandgate":
                    name = " ".join(["sandgate", *words[1:2]])
                out.append(name)
    return out


def _ids(examples: list[Example]) -> list[str]:
    return [e.where for e in examples]


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "sandgate.cli", "schema"], capture_output=True,
                       text=True, cwd=REPO, timeout=60, check=True)
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def test_the_pages_have_examples_of_each_kind() -> None:
    """Not vacuous: the collection finds the pages' examples."""
    assert len(YAML) >= 8 and len(RUN) >= 3 and JSON, (len(YAML), len(RUN), len(JSON))


def test_every_fence_names_its_language() -> None:
    bare = [e.where for e in EXAMPLES if not e.lang]
    assert not bare, f"fences without a language (use text for output): {bare}"


def test_every_shell_example_is_run_or_says_why_not() -> None:
    problems = []
    for e in EXAMPLES:
        if e.marker is None:
            continue
        kind, text = e.marker
        if kind == "not loaded":
            if e.lang not in ("yaml", "yml"):
                problems.append(f"{e.where}: `not loaded` before a {e.lang or 'bare'} fence")
            elif len(text) < 10:
                problems.append(f"{e.where}: `not loaded` needs its reason")
        elif e.lang not in SHELL:
            problems.append(f"{e.where}: a run marker before a {e.lang or 'bare'} fence")
        elif kind.startswith("not run") and len(text) < 10:
            problems.append(f"{e.where}: `{kind}` needs its reason")
        elif kind == "not run here":
            named = re.findall(r"tests/\S+\.py", text)
            if not named or not all((REPO / n).is_file() for n in named):
                problems.append(f"{e.where}: `not run here` must name the test that runs it")
        elif kind == "run" and not re.fullmatch(r"exits \d+", text):
            problems.append(f"{e.where}: expected <!-- run: exits N -->, got {text!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("example", RUN, ids=_ids(RUN))
def test_shell_example_runs(tmp_path: Path, example: Example) -> None:
    unsafe = sorted({c for c in _commands(example.body) if c not in RUNNABLE})
    assert not unsafe, (f"{example.where} would run {unsafe}: mark the fence "
                        "<!-- not run: REASON --> or keep to offline sandgate commands")
    expect = int(example.marker[1].split()[1]) if example.marker else 0
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(sys.prefix)
    (work / "policies").symlink_to(REPO / "policies")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VAULT_", "BAO_", "SANDGATE_"))}
    env.update(HOME=str(tmp_path), PATH=f"{sys.prefix}/bin:{env.get('PATH', '')}")
    script = work / "example.sh"
    script.write_text("set -euo pipefail\n" + example.body)
    # Its own session: whatever the example starts is ended with it, also on a timeout.
    proc = subprocess.Popen(["bash", str(script)], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == expect, (
        f"{example.where}: exit {proc.returncode}, expected {expect}\n{out[-3000:]}\n"
        f"{err[-3000:]}")


@pytest.mark.parametrize("example", YAML, ids=_ids(YAML))
def test_yaml_example_is_a_policy_that_holds(tmp_path: Path, schema: dict[str, Any],
                                             example: Example) -> None:
    _check_policy_example(tmp_path, schema, example)


def _check_policy_example(tmp_path: Path, schema: dict[str, Any], example: Example) -> None:
    from sandgate.policy.fixtures import run_policy_tests
    from sandgate.policy.loader import load_policy_dir
    from sandgate.review.proofs import prove

    files = policy_files(example)
    validator = jsonschema.Draft202012Validator(schema)
    whole = True
    for name, text in files.items():
        doc = yaml.safe_load(text)
        if isinstance(doc, dict) and "version" in doc:
            (tmp_path / name).write_text(text)
        elif isinstance(doc, dict) and doc and set(doc) <= TOP_LEVEL:
            doc, whole = {"version": "v1", **doc}, False
        elif isinstance(doc, list) and doc and all(isinstance(r, dict) for r in doc):
            doc, whole = {"version": "v1", "templates": {"example": doc}}, False
        else:
            raise AssertionError(
                f"{example.where} ({name}): neither a policy (`version: v1`), nor a part of one "
                f"(top-level sections, or a list of rules); if it is no policy, mark the fence "
                f"<!-- not loaded: REASON -->")
        errors = list(validator.iter_errors(doc))
        assert not errors, f"{example.where} ({name}): " + "; ".join(
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
    if not whole:
        return  # a part of a policy: the schema is all it can be held to
    policy = load_policy_dir(tmp_path)
    refuted = [str(p) for p in prove(policy) if not p.ok]
    assert not refuted, f"{example.where}: {refuted}"
    failed = [f"{r.test.identity} {r.test.method} {r.test.url}: {r.message}"
              for r in run_policy_tests(policy) if not r.passed]
    assert not failed, f"{example.where}: {failed}"


def test_only_offline_commands_run_unmarked() -> None:
    """The guard that keeps installers and servers out of the run examples sees them."""
    assert _commands("TOKEN=$(.venv/bin/sandgate token issue --identity a)\n"
                     ".venv/bin/sandgate ca > ca.pem && curl -x p \\\n  https://x\n"
                     "scripts/run.sh &  # serve\n"
                     ".venv/bin/sandgate run --policies policies\n") == [
        "sandgate token", "sandgate ca", "curl", "scripts/run.sh", "sandgate run"]


def test_a_part_of_a_policy_is_held_to_the_schema(tmp_path: Path, schema: dict[str, Any]) -> None:
    """Parts are checked, not waved through: a misspelt key in a rule list fails."""
    bad = Example(REPO / "README.md", 1, "yaml", "- {name: r, hosts: [x.example], pathz: [/]}\n",
                  None)
    with pytest.raises(AssertionError, match="pathz"):
        _check_policy_example(tmp_path, schema, bad)
    stray = Example(REPO / "README.md", 1, "yaml", "jobs: {check: {runs-on: x}}\n", None)
    with pytest.raises(AssertionError, match="not loaded"):
        _check_policy_example(tmp_path, schema, stray)


def test_multi_file_examples_are_split() -> None:
    """The composing example really is two files (the templates, then the identity using them)."""
    split = [policy_files(e) for e in YAML if len(policy_files(e)) > 1]
    assert any(set(f) == {"10-templates.yaml", "20-agent.yaml"} for f in split), split


@pytest.mark.parametrize("example", JSON, ids=_ids(JSON))
def test_json_example_parses(example: Example) -> None:
    """One JSON document, or JSON lines (audit events are one object a line)."""
    try:
        json.loads(example.body)
    except ValueError:
        for n, line in enumerate(example.body.splitlines(), 1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as e:
                    raise AssertionError(f"{example.where} +{n}: {e}") from None
