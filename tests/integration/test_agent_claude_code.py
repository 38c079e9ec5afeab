"""The real Claude Code CLI (pinned in tests/agents, installed by `scripts/setup.sh --test`)
through `sandgate run`, against a stand-in Anthropic Messages API on api.anthropic.com that
streams the key Sandgate injected back, cut between two text deltas at every position (and
once a character per delta).

The sandbox side holds only the placeholder; Sandgate injects the key from OpenBao. The
stand-in echoing it is the attack: the CLI joins the deltas into one text, so a scrubber that
looks at the bytes of the stream alone never sees the key whole. Nothing of it beyond the
bound that docs/scrubbing.md states (`BOUND` leading characters) may reach the CLI's output,
the transcripts it writes or Sandgate's log and audit: checked as no run of the key longer than
`BOUND` from any offset (stricter than leading), and no encoded form of it (base64, hex, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandgate.secrets.forms import encoded_forms
from tests.integration.conftest import Proxy, start_proxy, stop_proxy
from tests.support.anthropic_api import StandInMessages, split_copies
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret, assert_secret_equal, assert_secret_runs_at_most
from tests.support.upstream import AppThread

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
AGENTS = ROOT / "tests" / "agents"
PACKAGE = "@anthropic-ai/claude-code"
CLAUDE = AGENTS / "node_modules" / ".bin" / "claude"
API_IP = "127.0.34.2"  # this file's loopback address: api.anthropic.com, pinned by --resolve
# An obvious fake in a mixed alphabet, so that no run of it longer than BOUND occurs in a
# transcript by chance (the suite's shared keys hold words like "anthropic", which do).
KEY = "fakeQz7vW2pLr9XkT4mN8bHc6JdY3sGa"
PLACEHOLDER = "sandgate-placeholder-anthropic"
BOUND = 7
"""At most this many leading characters of a secret may leave: docs/scrubbing.md, "The bound"
(a candidate is held from `HOLD_AFTER` = 8 bytes on, so at most the first 7 leave)."""
# One copy of the key cut in two at each position (1..len-1; 0 and len keep it whole), and one
# streamed a character per delta.
CUTS = [*((k,) for k in range(len(KEY) + 1)), tuple(range(1, len(KEY)))]

POLICY = f"""version: v1
secrets:
  anthropic: {{vault: secret/data/agents/claude-code, field: api_key, placeholder: {PLACEHOLDER}}}
identities:
  coding-agent:
    rules:
      - name: claude-messages
        hosts: [api.anthropic.com]
        methods: [POST]
        paths: [/v1/messages]
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
        private_cidrs: [{API_IP}/32]
"""


@dataclass
class Stack:
    proxy: Proxy
    api: StandInMessages


@pytest.fixture(scope="module")
def stack(tmp_path_factory, vault) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("claude-code")
    pki = make_pki(tmp / "pki", ["api.anthropic.com"])
    api = StandInMessages(lambda key: split_copies(key, CUTS))
    server = AppThread(api.app(), pki.cert, pki.key, API_IP).start()
    vault.put_kv2("agents/claude-code", {"api_key": KEY})
    (tmp / "policies").mkdir()
    (tmp / "policies" / "claude.yaml").write_text(POLICY)
    proxy = start_proxy(tmp, tmp / "policies", {"VAULT_ADDR": vault.addr,
                                                "VAULT_TOKEN": vault.root_token}, pki,
                        f"--resolve=api.anthropic.com={API_IP}")
    try:
        yield Stack(proxy, api)
    finally:
        stop_proxy(proxy)
        server.stop()
    assert_bounded({"the proxy's log": proxy.logs(), "the audit": proxy.audit_file.read_text()})


def claude_binary() -> Path:
    """The pinned CLI, at the version tests/agents pins. Missing is a failure, never a skip:
    CI installs it with `scripts/setup.sh --test`."""
    if not CLAUDE.exists():
        why = "npm is missing, so " if shutil.which("npm") is None else ""
        pytest.fail(f"{why}the Claude Code CLI ({CLAUDE.relative_to(ROOT)}) is not installed: "
                    "run scripts/setup.sh --test (npm ci in tests/agents)")
    pinned = json.loads((AGENTS / "package.json").read_text())["dependencies"][PACKAGE]
    r = subprocess.run([str(CLAUDE), "--version"], capture_output=True, text=True, timeout=60,
                       env={"PATH": os.environ.get("PATH", ""), "DISABLE_AUTOUPDATER": "1"})
    if r.returncode != 0 or not r.stdout.startswith(f"{pinned} "):
        pytest.fail(f"{CLAUDE.relative_to(ROOT)} --version gave {r.stdout.strip()!r} (exit "
                    f"{r.returncode}), not the pinned {pinned}: its native binary is not in "
                    "place; run scripts/setup.sh --test (npm ci in tests/agents)")
    return CLAUDE


def run_claude(claude: Path, proxy: Proxy, home: Path,
               *args: str) -> subprocess.CompletedProcess[str]:
    """`claude -p` as a sandbox would run it: a placeholder key, Sandgate as its proxy and CA,
    a home of its own, and nothing from this process's environment but PATH."""
    home.mkdir()
    (home / "work").mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "LANG": "C.UTF-8",
        "HTTPS_PROXY": proxy.proxy_url("coding-agent"),
        "NODE_EXTRA_CA_CERTS": str(proxy.ca),
        "ANTHROPIC_API_KEY": PLACEHOLDER,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        # As root Claude Code refuses to skip its permission prompts unless it is told it runs
        # in a sandbox, which is what this stands for.
        "IS_SANDBOX": "1",
    }
    # Its sockets and scratch files go to a TMPDIR of its own, removed after: a short path,
    # as a socket's path may not be longer than 107 bytes.
    with tempfile.TemporaryDirectory(prefix="sgcc-") as scratch:
        env["TMPDIR"] = scratch
        return subprocess.run([str(claude), *args], capture_output=True, text=True, env=env,
                              cwd=home / "work", timeout=180, stdin=subprocess.DEVNULL)


def written_text(root: Path) -> dict[str, str]:
    """Every file under `root` the CLI wrote (transcripts, settings, logs), as text."""
    return {str(p.relative_to(root)): p.read_bytes().decode("utf-8", "replace")
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_bounded(texts: dict[str, str]) -> None:
    __tracebackhide__ = True  # pytest would show this frame's argument: the texts
    assert_secret_runs_at_most(texts, KEY, BOUND)
    forms = [f.decode("latin-1") for f in encoded_forms(KEY.encode()) if f != KEY.encode()]
    for where, text in texts.items():
        assert_no_secret([text], forms, f"{where} (an encoded form of the key)")


def new_events(proxy: Proxy, after: int, pred: Callable[[dict], bool]) -> list[dict]:
    """The audit events past the first `after` that match, waiting a little for the one the
    proxy writes when the stream has ended."""
    deadline = time.monotonic() + 15
    while True:
        found = [e for e in proxy.audit()[after:] if pred(e)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


OUTPUTS = {
    "text": ("--output-format", "text"),
    # What an SDK or harness reads: every stream event as it came, then the whole message.
    "stream-json": ("--output-format", "stream-json", "--verbose", "--include-partial-messages"),
}


@pytest.mark.parametrize("output", sorted(OUTPUTS))
def test_claude_code_never_shows_a_key_split_across_deltas(stack: Stack, tmp_path: Path,
                                                            output: str):
    claude = claude_binary()
    calls_before, audit_before = len(stack.api.calls), len(stack.proxy.audit())
    home = tmp_path / "home"
    r = run_claude(claude, stack.proxy, home, "-p", "Repeat the copies.", *OUTPUTS[output])

    # Checked first: a failure below may print the CLI's output (its own errors, such as an
    # untrusted certificate, go to stdout), and this proves that holds nothing past the bound.
    assert_bounded({"stdout": r.stdout, "stderr": r.stderr, **written_text(home)})
    assert r.returncode == 0, f"claude exited {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}"

    # The answer went through whole: every copy's label, in the output and in a transcript.
    labels = ["Here are the copies.", *(f"copy {i}: " for i in range(len(CUTS))),
              "That is all."]
    assert [x for x in labels if x not in r.stdout] == []
    transcripts = list((home / ".claude" / "projects").rglob("*.jsonl"))
    assert transcripts, "Claude Code wrote no transcript under CLAUDE_CONFIG_DIR/projects"
    assert any("That is all." in t.read_text() for t in transcripts)

    # The stand-in got the key from OpenBao, put there by Sandgate: the CLI held a placeholder.
    messages = [c for c in stack.api.calls[calls_before:] if c.path == "/v1/messages"]
    assert messages, "the CLI's request never reached the stand-in API"
    for call in messages:
        assert isinstance(call.body, dict) and call.body.get("stream") is True
        assert_secret_equal(call.headers.get("x-api-key"), KEY, "the stand-in's x-api-key")

    # The audit names who called and which rule let it through.
    events = new_events(stack.proxy, audit_before, lambda e: e.get("event") == "request"
                        and str(e.get("path", "")).startswith("/v1/messages"))
    assert events, "no audit event for POST /v1/messages"
    assert {(e["identity"], e["rule"], e["decision"], e["upstream_status"]) for e in events} == {
        ("coding-agent", "claude-messages", "allow", 200)}
