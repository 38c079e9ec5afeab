"""`sandgate demo`, as a newcomer runs it: real OpenBao, the real proxy process, the TLS stand-in
API, offline. It must show the injected key by its fingerprint (never the value), the bash tool's
refusal with its code, the reflected key scrubbed with the audit's redaction count, `explain`
for the same requests, and leave nothing behind: no process, no temporary directory. Also when
it is interrupted (Ctrl-C reaches the whole process group; SIGTERM only the demo)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandgate.demo.upstream import fingerprint
from sandgate.secrets.devserver import DEMO_SECRETS

KEY = DEMO_SECRETS["llm/anthropic"]["api_key"]


def _env(tmp: Path) -> dict[str, str]:
    # A private TMPDIR: every directory the demo makes (its own, OpenBao's) lands in it, so
    # "nothing left" is checkable, and no other test's directories are taken for the demo's.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VAULT_", "BAO_"))}
    env["TMPDIR"] = str(tmp)
    return env


def _left_behind(tmp: Path) -> list[str]:
    """Files under tmp, and processes whose command line or working directory is under it."""
    left = [str(p) for p in tmp.rglob("*")]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if str(tmp) in cmdline or cwd.startswith(str(tmp)):
            left.append(f"pid {proc.name}: {cmdline[:200]}")
    return left


def _in_group(pgid: int) -> list[str]:
    """The processes of process group `pgid` other than its leader (the demo)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == pgid:
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        if int(fields[2]) == pgid:
            found.append(f"pid {proc.name} {stat.split(' ', 2)[1]}")
    return found


def _gone(tmp: Path, timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _left_behind(tmp)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_demo_shows_injection_refusal_scrubbing_and_explain(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-m", "sandgate.cli", "demo"], capture_output=True,
                       text=True, env=_env(tmp), timeout=120)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    lines = out.splitlines()

    def line_after(prefix: str) -> str:
        i = next(i for i, ln in enumerate(lines) if ln.startswith(prefix))
        return lines[i + 1]

    # 1: the agent held the placeholder; the API received the Vault value, shown by fingerprint.
    assert "x-api-key: sandgate-placeholder-anthropic" in out
    first = line_after("1. coding-agent")
    assert f"-> 200: the API received x-api-key {fingerprint(KEY)}" in first, out
    assert "rule 'llm'" in first
    # 2: the bash tool is refused, with the code and the reason.
    second = line_after("2. bash-tool")
    assert "-> 403 no_rule: identity 'bash-tool' has no rule allowing" in second, out
    # 3: the reflected key came back scrubbed from the header and the body: two redactions.
    third = line_after("3. coding-agent")
    assert "x-echo-api-key: [REDACTED:anthropic]" in third, out
    assert '"x-api-key": "[REDACTED:anthropic]"' in third
    assert third.endswith("redactions in the audit event: 2"), third
    # 4: explain, for the same requests.
    explain = out.split("4. sandgate explain POST", 1)[1]
    assert "coding-agent: allow by rule 'llm'" in explain
    assert "inject header x-api-key: from secret(s) anthropic" in explain
    assert "bash-tool: deny no_rule" in explain
    # Never the value, anywhere.
    assert KEY not in out and KEY not in r.stderr
    assert "Done in" in lines[-1]
    assert not _gone(tmp), _left_behind(tmp)


def _proxy_groups(demo: int) -> list[int]:
    """The process groups of the demo's `sandgate run` (its proxy: a group of its own)."""
    groups = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state ppid pgrp ...
        if int(fields[1]) == demo and b"run" in cmdline and b"sandgate.cli" in cmdline:
            groups.append(int(fields[2]))
    return groups


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_demo_interrupted_leaves_nothing(tmp_path: Path, how: str) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # The tour takes a second or two: on a loaded machine it may end before this test reads
    # its first line. So the proxy is held (SIGSTOP) as soon as the line is read, which holds
    # the tour in its next request; a demo that had already ended is started again.
    for _ in range(3):
        # as a terminal starts a foreground command: SIGINT at its default, whatever this
        # process inherited (a job started in the background of a script ignores SIGINT, and
        # so would the demo: CI saw tours run to the end through the signal)
        proc = subprocess.Popen([sys.executable, "-m", "sandgate.cli", "demo"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env(tmp), start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        held: list[int] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # once the stack is up: Sandgate, OpenBao and the API run
                if line.startswith("  Sandgate"):
                    break
            else:
                raise AssertionError(f"the demo ended early: {proc.wait()} {proc.stderr.read()}")
            held = _proxy_groups(proc.pid)
            for g in held:
                os.killpg(g, signal.SIGSTOP)
            if not held or proc.poll() is not None:  # the tour was over: once more
                proc.wait(60)
                assert not _gone(tmp), _left_behind(tmp)
                continue
            assert _left_behind(tmp), "the demo's processes and directory exist while it runs"
            # Ctrl-C must reach the demo alone: a child in its group would stop on its own,
            # racing the demo's orderly stop (the proxy closing a request of the tour read as a
            # failure)
            in_group = _in_group(proc.pid)
            assert not in_group, f"children in the demo's process group: {in_group}"
            if how == "ctrl-c":  # a terminal sends SIGINT to the whole foreground process group
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGTERM)
            for g in held:  # the proxy goes on, to be stopped by the demo
                os.killpg(g, signal.SIGCONT)
            rc = proc.wait(60)
            assert proc.stdout is not None
            if rc == 0 and "Done in" in proc.stdout.read():
                # the whole tour ran: the signal came after its last step (CI, loaded: seen
                # twice in about ten runs, not understood); what is under test did not happen
                assert not _gone(tmp), _left_behind(tmp)
                continue
            break
        finally:
            for g in held:
                with contextlib.suppress(OSError):
                    os.killpg(g, signal.SIGCONT)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    else:
        raise AssertionError("the demo's tour ended before it was interrupted, 3 times")
    assert rc == 130, proc.stderr.read() if proc.stderr else rc
    assert not _gone(tmp), _left_behind(tmp)


def test_run_with_the_dev_vault_keeps_it_through_the_drain(tmp_path: Path) -> None:
    """`sandgate run` without VAULT_ADDR starts an embedded OpenBao: a terminal's Ctrl-C (the
    whole foreground group) reaches the proxy alone, which drains while the server still
    answers, then stops it; nothing is left behind."""
    import socket

    from sandgate.secrets.devserver import free_port

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandgate.cli", "run", "--policies", "policies", "--confdir",
         str(tmp_path / "conf"), "--listen", f"127.0.0.1:{port}", "--no-watch", "--audit",
         str(tmp_path / "audit.jsonl"), "--drain-timeout", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(tmp),
        cwd=Path(__file__).resolve().parents[2], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
                assert time.monotonic() < deadline, "sandgate run did not listen within 60 s"
                time.sleep(0.2)
        assert any("bao" in p for p in _left_behind(tmp)), _left_behind(tmp)
        in_group = _in_group(proc.pid)
        assert not any("(bao)" in p for p in in_group), in_group
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not _gone(tmp), _left_behind(tmp)  # the server and its directory
    assert rc == 0, proc.stderr.read() if proc.stderr else rc
