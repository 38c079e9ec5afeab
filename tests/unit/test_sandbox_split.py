"""Pattern 1 with the split, the pure parts: the sandbox's rules, the tool's environment, the
runner's requests, and Sandgate's (sandbox, listener) -> identity mapping."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.errors import Code, IdentityError
from sandgate.identity.base import Caller
from sandgate.identity.resolve import Identifier
from sandgate.identity.roles import Role, Split, parse_role_listen, parse_tool_identity, split_from
from sandgate.pattern1 import rules, toolrunner
from sandgate.pattern1.rules import SplitConfigError, SplitNet
from sandgate.sandbox.split import SplitPorts
from sandgate.tokens import issue_token

KEY = b"k" * 32
IP = "172.30.99.5"
NET = SplitNet(gateway="172.30.99.1", agent_ports=(8080,), tool_port=8081, other_port=8082,
               agent_uid=1000, tool_uid=1001)


# --- the rules ----------------------------------------------------------------------------------

def test_rules_send_each_user_to_its_listener() -> None:
    text = rules.iptables_v4(NET)
    nat = text[text.index("*nat"):text.index("COMMIT")].splitlines()
    assert nat[5:] == [
        "-A OUTPUT -o lo -j RETURN",
        "-A OUTPUT -m owner --uid-owner 1000 -j RETURN",
        "-A OUTPUT -p tcp -m owner --uid-owner 1001 -j DNAT --to-destination 172.30.99.1:8081",
        "-A OUTPUT -p tcp -j DNAT --to-destination 172.30.99.1:8082",
    ]
    filt = text[text.index("*filter"):].splitlines()
    assert ":OUTPUT DROP [0:0]" in filt
    assert filt.index("-A OUTPUT -d 127.0.0.11/32 -j REJECT") < filt.index(
        "-A OUTPUT -o lo -j ACCEPT")  # no DNS, even over loopback
    agent_ok = filt.index("-A OUTPUT -d 172.30.99.1/32 -p tcp -m owner --uid-owner 1000 -m tcp "
                          "--dport 8080 -j ACCEPT")
    assert filt[agent_ok + 1] == "-A OUTPUT -m owner --uid-owner 1000 -j REJECT"  # nothing else
    assert "-A OUTPUT -d 172.30.99.1/32 -p tcp -m owner --uid-owner 1001 -m tcp --dport 8081 " \
           "-j ACCEPT" in filt
    assert filt[-2] == '-A OUTPUT -m comment --comment "sandgate-split" -j REJECT'
    assert rules.applied(text, NET) == []


def test_the_agent_keeps_every_agent_port_and_nothing_else() -> None:
    net = SplitNet(gateway="10.9.0.1", agent_ports=(8080, 8443), tool_port=9001,
                   other_port=9002, agent_uid=1000, tool_uid=1001)
    text = rules.iptables_v4(net)
    accepted = [ln for ln in text.splitlines() if "--uid-owner 1000" in ln and "ACCEPT" in ln]
    assert accepted == [
        f"-A OUTPUT -d 10.9.0.1/32 -p tcp -m owner --uid-owner 1000 -m tcp --dport {port} "
        "-j ACCEPT" for port in (8080, 8443)]  # not the tool listener, nothing else


def test_ipv6_allows_only_loopback() -> None:
    lines = rules.iptables_v6().splitlines()
    assert ":OUTPUT DROP [0:0]" in lines
    assert [ln for ln in lines if ln.startswith("-A")] == [
        "-A OUTPUT -o lo -j ACCEPT", '-A OUTPUT -m comment --comment "sandgate-split" -j REJECT']


def test_applied_names_what_is_missing() -> None:
    missing = rules.applied(":OUTPUT ACCEPT [0:0]\n", NET)
    assert ":OUTPUT DROP" in missing and rules.MARK in missing


@pytest.mark.parametrize(("change", "words"), [
    ({"gateway": "example.test"}, "not an IPv4"),
    ({"gateway": "127.0.0.1"}, "cannot be reached"),
    ({"tool_port": 8080}, "distinct"),
    ({"other_port": 8081}, "distinct"),
    ({"agent_ports": ()}, "distinct"),
    ({"tool_port": 70000}, "out of range"),
    ({"tool_uid": 1000}, "two distinct non-root"),
    ({"agent_uid": 0}, "two distinct non-root"),
])
def test_bad_settings_are_refused(change: dict[str, object], words: str) -> None:
    import dataclasses

    with pytest.raises(SplitConfigError, match=words):
        rules.iptables_v4(dataclasses.replace(NET, **change))  # type: ignore[arg-type]


def test_split_net_from_the_environment() -> None:
    env = {"HTTPS_PROXY": "http://coding-agent:sg1.x.y@172.30.99.1:8080",
           "SANDGATE_SPLIT_TOOL_PORT": "8081", "SANDGATE_SPLIT_OTHER_PORT": "8082"}
    assert rules.split_net(env, 1000, 1001) == NET
    env["SANDGATE_SPLIT_AGENT_PORTS"] = "8080,8443"
    assert rules.split_net(env, 1000, 1001).agent_ports == (8080, 8443)
    with pytest.raises(SplitConfigError, match="HTTPS_PROXY"):
        rules.split_net({**env, "HTTPS_PROXY": ""}, 1000, 1001)
    with pytest.raises(SplitConfigError, match="SANDGATE_SPLIT_TOOL_PORT"):
        rules.split_net({**env, "SANDGATE_SPLIT_TOOL_PORT": "x"}, 1000, 1001)
    with pytest.raises(SplitConfigError, match="SANDGATE_SPLIT_AGENT_PORTS"):
        rules.split_net({**env, "SANDGATE_SPLIT_AGENT_PORTS": "80,x"}, 1000, 1001)


def test_the_launcher_environment_is_what_the_entrypoint_reads() -> None:
    env = {"HTTPS_PROXY": "http://172.30.99.1:8080", **SplitPorts(8081, 8082).environment()}
    assert rules.split_net(env, 1000, 1001) == NET


# --- the tool's environment ---------------------------------------------------------------------

def test_tool_environment_has_no_agent_credential() -> None:
    token = "sg1.agent-token.fake"
    env = {"HTTPS_PROXY": f"http://coding-agent:{token}@172.30.99.1:8080",
           "npm_config_proxy": f"http://coding-agent:{token}@172.30.99.1:8080",
           "SOMETHING": f"prefix-{token}", "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
           "SANDGATE_SPLIT_TOOL_PORT": "8081", "HOME": "/home/agent"}
    out = rules.tool_environment(env, NET, "/home/tool", rules.proxy_secrets(env))
    assert rules.proxy_secrets(env) == [token]
    assert token not in json.dumps(out)
    assert all(out[name] == "http://172.30.99.1:8081" for name in rules.PROXY_VARS)
    assert out["SSL_CERT_FILE"] == env["SSL_CERT_FILE"]
    assert out["HOME"] == "/home/tool" and out["USER"] == "tool"
    assert "SOMETHING" not in out and "SANDGATE_SPLIT_TOOL_PORT" not in out


# --- the runner's requests ----------------------------------------------------------------------

def test_runner_argv_drops_before_chdir_and_times_out() -> None:
    drop = ["setpriv", "--reuid=1001", "--"]
    assert toolrunner.tool_argv(drop, "echo hi", 1.2, "/workspace") == [
        *drop, "env", "--chdir=/workspace", "timeout", "--kill-after=5", "2", "bash", "-c",
        "echo hi"]
    assert toolrunner.tool_argv(drop, ["ls", "-l"], 99999, "/")[-3:] == ["3600", "ls", "-l"]
    with pytest.raises(toolrunner.RunnerError):
        toolrunner.tool_argv(drop, [], 1, "/")


@pytest.mark.parametrize(("raw", "words"), [
    (b"not json", "not JSON"),
    (b"[1]", "JSON object"),
    (b'{"cmd": ""}', "cmd must"),
    (b'{"cmd": ["ls", 1]}', "cmd must"),
    (b'{"cmd": "ls", "timeout": 0}', "timeout"),
    (b'{"cmd": "ls", "timeout": true}', "timeout"),
    (b'{"cmd": "ls", "cwd": "relative"}', "absolute"),
])
def test_runner_refuses_bad_requests(raw: bytes, words: str) -> None:
    with pytest.raises(toolrunner.RunnerError, match=words):
        toolrunner.parse_request(raw)


@given(st.text(min_size=1), st.floats(min_value=0.001, max_value=1e6))
def test_runner_accepts_any_command_text(cmd: str, timeout: float) -> None:
    raw = json.dumps({"cmd": cmd, "timeout": timeout, "cwd": "/workspace"}).encode()
    assert toolrunner.parse_request(raw) == (cmd, timeout, "/workspace")


# --- Sandgate's mapping -------------------------------------------------------------------------

SPLIT = Split(listeners={8081: Role.TOOL, 8082: Role.OTHER}, tools={"coding-agent": "bash-tool"})
AGENT = Caller("coding-agent", "sbx-1", "docker", split=True)


class _Addr:
    def __init__(self, caller: Caller | None) -> None:
        self.caller = caller

    def lookup(self, client_ip: str) -> Caller | None:
        return self.caller if client_ip == IP else None


def _basic(identity: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{identity}:{token}".encode()).decode()


def _ident(caller: Caller | None = AGENT, split: Split | None = SPLIT) -> Identifier:
    return Identifier(KEY, (_Addr(caller),), split)


def test_agent_listener_is_the_agent() -> None:
    got = _ident().identify(None, IP, None)
    assert (got.identity, got.sandbox, got.source) == ("coding-agent", "sbx-1", "docker/agent")
    token = issue_token(KEY, "coding-agent", "sbx-1")
    assert _ident().identify(_basic("coding-agent", token), IP, 8080).identity == "coding-agent"


def test_tool_listener_is_the_tool_whatever_token() -> None:
    got = _ident().identify(None, IP, 8081)
    assert (got.identity, got.sandbox, got.source) == ("bash-tool", "sbx-1", "docker/tool")
    agent_token = issue_token(KEY, "coding-agent", "sbx-1")
    with pytest.raises(IdentityError, match="disagrees") as e:
        _ident().identify(_basic("coding-agent", agent_token), IP, 8081)
    assert e.value.code == Code.AUTH_INVALID
    assert agent_token not in str(e.value)
    tool_token = issue_token(KEY, "bash-tool", "sbx-1")
    assert _ident().identify(_basic("bash-tool", tool_token), IP, 8081).identity == "bash-tool"
    other_sandbox = issue_token(KEY, "bash-tool", "sbx-2")
    with pytest.raises(IdentityError):
        _ident().identify(_basic("bash-tool", other_sandbox), IP, 8081)


def test_tool_listener_fails_closed() -> None:
    with pytest.raises(IdentityError, match="no sandbox is known"):
        _ident().identify(None, "10.0.0.9", 8081)
    with pytest.raises(IdentityError, match="no tool identity"):
        _ident(Caller("web-fetch", "sbx-1", "docker", split=True)).identify(None, IP, 8081)
    with pytest.raises(IdentityError, match="without the split"):
        _ident(Caller("coding-agent", "sbx-1", "docker", split=False)).identify(None, IP, 8081)
    with pytest.raises(IdentityError, match="identified by address"):
        Identifier(KEY, (), SPLIT).identify(
            _basic("bash-tool", issue_token(KEY, "bash-tool")), IP, 8081)


def test_other_listener_is_always_refused() -> None:
    for auth in (None, _basic("coding-agent", issue_token(KEY, "coding-agent", "sbx-1"))):
        with pytest.raises(IdentityError, match="neither the agent nor its bash tool") as e:
            _ident().identify(auth, IP, 8082)
        assert "sbx-1" in str(e.value)


def test_unsplit_sandbox_is_audited_as_such() -> None:
    unsplit = Caller("coding-agent", "sbx-1", "docker", split=False)
    assert _ident(unsplit).identify(None, IP, None).source == "docker/unsplit"
    # identities without a tool, and sources that cannot tell, are left as they are
    assert _ident(Caller("web-fetch", "s", "docker", split=False)).identify(
        None, IP, None).source == "docker"
    assert _ident(Caller("coding-agent", "s", "cidr")).identify(None, IP, None).source == "cidr"
    assert _ident(unsplit, None).identify(None, IP, None).source == "docker"


def test_split_from_flags() -> None:
    split, listens = split_from(["tool=0.0.0.0:8081", "other=[::]:8082"],
                                ["coding-agent=bash-tool"])
    assert split == Split({8081: Role.TOOL, 8082: Role.OTHER}, {"coding-agent": "bash-tool"})
    assert listens == [(Role.TOOL, "0.0.0.0", 8081), (Role.OTHER, "::", 8082)]
    assert split_from([], []) == (None, [])


@pytest.mark.parametrize(("listen", "tools", "words"), [
    (["agent=0.0.0.0:8081"], ["a=b"], "one of tool, other"),
    (["tool=0.0.0.0"], ["a=b"], "ROLE=HOST:PORT"),
    (["tool=h:0"], ["a=b"], "ROLE=HOST:PORT"),
    (["other=h:8082"], ["a=b"], "needs --role-listen tool"),
    (["tool=h:8081"], [], "needs --tool-identity"),
    (["tool=h:8081", "other=h:8081"], ["a=b"], "given twice"),
    (["tool=h:8081"], ["a=a"], "must differ"),
    (["tool=h:8081"], ["a=b", "a=c"], "two tool identities"),
    (["tool=h:8081"], ["a"], "AGENT=TOOL"),
])
def test_split_flags_errors(listen: list[str], tools: list[str], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        split_from(listen, tools)


def test_parsers() -> None:
    assert parse_role_listen("tool=127.0.0.1:9") == (Role.TOOL, "127.0.0.1", 9)
    assert parse_tool_identity(" a = b ") == ("a", "b")
