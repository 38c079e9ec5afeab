"""Pattern 1 without a hook: a socket's owner from /proc (sandgate.identity.sockowner), the
identity it stands for (sandgate.identity.agents), and the Identifier's fail-closed rule."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from sandgate.errors import IdentityError
from sandgate.identity.agents import (
    AgentProcesses,
    Registration,
    agents_from,
    parse_registration,
    prune,
)
from sandgate.identity.resolve import Identifier
from sandgate.identity.sockowner import (
    Endpoint,
    find_inode,
    format_endpoint,
    holds,
    parse_endpoint,
    socket_inode,
    start_time,
)
from sandgate.tokens import issue_token

KEY = b"k" * 32
HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
          "timeout inode")
PROXY = Endpoint.of("127.0.0.1", 8080)
AGENT, TOOL, OTHER_NS = 4242, 4343, 5151


def line(local: Endpoint, remote: Endpoint, inode: int, v6: bool = False) -> str:
    return (f"   0: {format_endpoint(local, v6)} {format_endpoint(remote, v6)} 01 "
            f"00000000:00000000 00:00000000 00000000     0        0 {inode} 1 0000000000000000")


class FakeProc:
    """A /proc with the processes a test needs: stat (start time), ns/net, fd, net/tcp{,6}."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def process(self, pid: int, start: int, netns: str, sockets: list[int],
                tcp: list[str] = (), tcp6: list[str] = ()) -> None:  # type: ignore[assignment]
        d = self.root / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "ns").mkdir()
        (d / "net").mkdir()
        (d / "stat").write_text(f"{pid} (a (weird) name) S " + " ".join(
            ["1"] * 18 + [str(start)] + ["0"] * 10) + "\n")
        os.symlink(netns, d / "ns" / "net")
        for fd, inode in enumerate(sockets, start=3):
            os.symlink(f"socket:[{inode}]", d / "fd" / str(fd))
        os.symlink("/dev/null", d / "fd" / "0")
        (d / "net" / "tcp").write_text("\n".join([HEADER, *tcp]) + "\n")
        (d / "net" / "tcp6").write_text("\n".join([HEADER, *tcp6]) + "\n")


@pytest.fixture()
def world(tmp_path: Path) -> tuple[FakeProc, Path]:
    proc = FakeProc(tmp_path / "proc")
    agents = tmp_path / "agents"
    agents.mkdir(mode=0o755)
    os.chmod(agents, 0o755)
    return proc, agents


def register(agents: Path, reg: Registration) -> None:
    path = agents / f"{reg.pid}.json"
    path.write_text(reg.to_json())
    os.chmod(path, 0o644)


ADDRS = hs.one_of(
    hs.integers(0, 2**32 - 1).map(ipaddress.IPv4Address),
    hs.integers(0, 2**128 - 1).map(ipaddress.IPv6Address),
)


@given(ADDRS, hs.integers(0, 65535), hs.booleans(), hs.sampled_from(["little", "big"]))
def test_endpoint_round_trip(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int,
                             v6: bool, order: str) -> None:
    ep = Endpoint.of(str(addr), port)
    assert parse_endpoint(format_endpoint(ep, v6 or ep.address.version == 6, order), order) == ep


def test_endpoint_as_the_kernel_prints_it() -> None:
    # the values of a real little-endian /proc/net/tcp line
    assert parse_endpoint("0100007F:1F90", "little") == Endpoint.of("127.0.0.1", 8080)
    assert parse_endpoint("0000000000000000FFFF00000100007F:1F90", "little") == \
        Endpoint.of("::ffff:127.0.0.1", 8080) == Endpoint.of("127.0.0.1", 8080)
    assert parse_endpoint("00000000000000000000000001000000:0016", "little") == \
        Endpoint.of("::1", 22)


ENDPOINTS = hs.builds(lambda a, p: Endpoint.of(str(a), p), ADDRS, hs.integers(0, 65535))


@given(hs.lists(hs.tuples(ENDPOINTS, ENDPOINTS, hs.integers(0, 2**32), hs.booleans()),
                max_size=8), ENDPOINTS, ENDPOINTS, hs.integers(1, 2**32), hs.booleans(),
       hs.integers(0, 8))
def test_find_inode_finds_exactly_its_connection(others, local, remote, inode, v6, at) -> None:
    """Whatever else the table holds (other connections, tcp6 spellings of IPv4), the entry
    local -> remote is found with its inode; and only it."""
    others = [o for o in others if (o[0], o[1]) != (local, remote)]
    v6 = v6 or local.address.version == 6 or remote.address.version == 6
    lines = [line(a, b, i, w or a.address.version == 6 or b.address.version == 6)
             for a, b, i, w in others]
    at = min(at, len(lines))
    lines.insert(at, line(local, remote, inode, v6))
    assert find_inode([HEADER, *lines], local, remote) == inode
    assert find_inode([HEADER, *lines[:at], *lines[at + 1:]], local, remote) is None


@pytest.mark.parametrize("bad", ["", "0100007F", "0100007F:1F9", "01007F:1F90", "XX00007F:1F90"])
def test_bad_endpoint(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoint(bad)


def test_find_inode_skips_orphans_garbage_and_other_connections() -> None:
    me = Endpoint.of("127.0.0.1", 40000)
    lines = [HEADER, "garbage", "   1: ZZ:ZZ 00:00 01 " + "0 " * 8,
             line(me, Endpoint.of("127.0.0.1", 9999), 11),  # the same port, another peer
             line(Endpoint.of("127.0.0.1", 40001), PROXY, 12),
             line(me, PROXY, 13)]
    assert find_inode(lines, me, PROXY) == 13
    assert find_inode([HEADER, line(me, PROXY, 0)], me, PROXY) is None  # orphan: no owner
    assert find_inode([line(me, PROXY, 13)], me, PROXY) is None  # the first line is the header


def test_real_proc_finds_this_process_socket() -> None:
    """The real kernel's byte order and tables: this process's own connection."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    with srv, socket.create_connection(srv.getsockname()) as c:
        peer = Endpoint.of(*c.getsockname()[:2])
        local = Endpoint.of(*srv.getsockname()[:2])
        inode = socket_inode(Path("/proc"), os.getpid(), peer, local)
        assert inode is not None and inode == os.fstat(c.fileno()).st_ino
        assert holds(Path("/proc"), os.getpid(), inode)
        assert not holds(Path("/proc"), os.getppid(), inode)
        assert socket_inode(Path("/proc"), os.getpid(), local, peer) != inode  # direction
    assert start_time(Path("/proc"), os.getpid()) is not None


def setup(world: tuple[FakeProc, Path], sock_of: int) -> tuple[AgentProcesses, Endpoint]:
    """An agent (pid AGENT) and its tool (pid TOOL) in one namespace; a connection held by
    `sock_of`'s process (inode 77)."""
    proc, agents = world
    peer = Endpoint.of("127.0.0.1", 40000)
    table = [line(peer, PROXY, 77), line(Endpoint.of("127.0.0.1", 40002), PROXY, 0)]
    proc.process(AGENT, 100, "net:[1]", [77] if sock_of == AGENT else [5], table)
    proc.process(TOOL, 200, "net:[1]", [77] if sock_of == TOOL else [6], table)
    register(agents, Registration(AGENT, 100, "coding-agent", "bash-tool"))
    return AgentProcesses(agents, {"coding-agent": "bash-tool"}, proc.root), peer


def test_the_agent_process_is_the_agent(world: tuple[FakeProc, Path]) -> None:
    ap, peer = setup(world, AGENT)
    caller = ap.identify(peer, PROXY)
    assert caller is not None and (caller.identity, caller.source) == (
        "coding-agent", "process/agent")


def test_any_other_process_is_the_tool(world: tuple[FakeProc, Path]) -> None:
    ap, peer = setup(world, TOOL)
    caller = ap.identify(peer, PROXY)
    assert caller is not None and (caller.identity, caller.source) == ("bash-tool", "process/tool")
    # an orphan socket (closed by its process) has no owner: never the agent, whatever token
    assert ap.identify(Endpoint.of("127.0.0.1", 40002), PROXY) is None
    with pytest.raises(IdentityError, match="only to its registered agent process"):
        Identifier(KEY, agents=ap).identify(
            basic("coding-agent", issue_token(KEY, "coding-agent")), "127.0.0.1", None,
            (("127.0.0.1", 40002), ("127.0.0.1", 8080)))


def test_a_dead_or_reused_pid_is_no_agent(world: tuple[FakeProc, Path]) -> None:
    _proc, agents = world
    ap, peer = setup(world, AGENT)
    register(agents, Registration(AGENT, 99, "coding-agent", "bash-tool"))  # another start
    assert ap.registered() == []
    assert ap.identify(peer, PROXY) is None  # not decided here, and then fail closed:
    ident = Identifier(KEY, agents=ap)
    token = issue_token(KEY, "coding-agent")
    with pytest.raises(IdentityError, match="only to its registered agent process"):
        ident.identify(basic("coding-agent", token), "127.0.0.1", None,
                       (("127.0.0.1", 40000), ("127.0.0.1", 8080)))


def test_untrusted_registrations_are_ignored(world: tuple[FakeProc, Path]) -> None:
    _proc, agents = world
    ap, _peer = setup(world, AGENT)
    os.chmod(agents / f"{AGENT}.json", 0o666)
    assert ap.registered() == []
    os.chmod(agents / f"{AGENT}.json", 0o644)
    os.chmod(agents, 0o777)
    assert ap.registered() == []
    os.chmod(agents, 0o755)
    # a registration whose tool identity --agent-split does not name
    register(agents, Registration(AGENT, 100, "coding-agent", "root-tool"))
    assert ap.registered() == []


def test_another_namespace_is_not_decided(world: tuple[FakeProc, Path]) -> None:
    _proc, _agents = world
    ap, _peer = setup(world, AGENT)
    assert ap.identify(Endpoint.of("127.0.0.1", 41000), PROXY) is None


def basic(user: str, token: str) -> str:
    import base64
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()


def test_the_owner_decides_not_the_token(world: tuple[FakeProc, Path]) -> None:
    ap, _peer = setup(world, TOOL)
    ident = Identifier(KEY, agents=ap)
    conn = (("127.0.0.1", 40000), ("127.0.0.1", 8080))
    agent_token = issue_token(KEY, "coding-agent")
    with pytest.raises(IdentityError, match="disagrees with the process"):
        ident.identify(basic("coding-agent", agent_token), "127.0.0.1", None, conn)
    assert ident.identify(None, "127.0.0.1", None, conn).identity == "bash-tool"
    tool_token = issue_token(KEY, "bash-tool")
    assert ident.identify(basic("bash-tool", tool_token), "127.0.0.1", None,
                          conn).identity == "bash-tool"
    # the gateway's bare token: the same rule
    with pytest.raises(IdentityError, match="disagrees with the process"):
        ident.identify_token(agent_token, "127.0.0.1", None, conn)


def test_agent_with_its_token_and_without(world: tuple[FakeProc, Path]) -> None:
    ap, _peer = setup(world, AGENT)
    ident = Identifier(KEY, agents=ap)
    conn = (("127.0.0.1", 40000), ("127.0.0.1", 8080))
    assert ident.identify(basic("coding-agent", issue_token(KEY, "coding-agent")),
                          "127.0.0.1", None, conn).source == "process/agent"
    assert ident.identify(None, "127.0.0.1", None, conn).identity == "coding-agent"


def test_no_connection_never_gets_the_agent(world: tuple[FakeProc, Path]) -> None:
    ap, _ = setup(world, AGENT)
    ident = Identifier(KEY, agents=ap)
    with pytest.raises(IdentityError, match="no client socket to look up"):
        ident.identify_token(issue_token(KEY, "coding-agent"), "127.0.0.1")
    # identities that are not agents are identified as before
    assert ident.identify_token(issue_token(KEY, "ci"), "127.0.0.1").identity == "ci"


def test_agents_sharing_a_namespace_with_different_tools(world: tuple[FakeProc, Path]) -> None:
    proc, agents = world
    _ap, peer = setup(world, TOOL)
    proc.process(OTHER_NS, 300, "net:[1]", [], [])
    register(agents, Registration(OTHER_NS, 300, "reviewer", "review-tool"))
    ap2 = AgentProcesses(agents, {"coding-agent": "bash-tool", "reviewer": "review-tool"},
                         proc.root)
    with pytest.raises(IdentityError, match="its own network namespace"):
        ap2.identify(peer, PROXY)


@pytest.mark.parametrize("text", ['[]', '{"pid": 0, "start": 1, "identity": "a", '
                                  '"tool_identity": "b"}', '{"pid": 1, "start": true, '
                                  '"identity": "a", "tool_identity": "b"}', 'nope'])
def test_bad_registrations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_registration(text)


def test_flags(tmp_path: Path) -> None:
    assert agents_from(None, []) is None
    with pytest.raises(ValueError, match="needs --agent-dir"):
        agents_from(None, ["a=b"])
    with pytest.raises(ValueError, match="needs --agent-split"):
        agents_from(tmp_path, [])
    with pytest.raises(ValueError, match="--agent-split 'a=a'"):
        agents_from(tmp_path, ["a=a"])
    os.chmod(tmp_path, 0o777)
    with pytest.raises(ValueError, match="chmod go-w"):
        agents_from(tmp_path, ["a=b"])


def test_unreadable_fds_fail_closed_with_a_fix(world: tuple[FakeProc, Path]) -> None:
    """Sandgate running as another user than the agent, without CAP_SYS_PTRACE: refused with
    the fix, never the tool's identity for the agent's own calls, nor the agent's."""
    proc, _ = world
    ap, peer = setup(world, AGENT)
    fd_dir = proc.root / str(AGENT) / "fd"
    for link in fd_dir.iterdir():
        link.unlink()
    fd_dir.rmdir()
    fd_dir.write_text("")  # listing it fails (as EACCES would), unlike a process that is gone
    with pytest.raises(IdentityError, match="CAP_SYS_PTRACE"):
        ap.identify(peer, PROXY)


def test_prune_removes_exited_agents_only(world: tuple[FakeProc, Path]) -> None:
    proc, agents = world
    setup(world, AGENT)  # AGENT registered, alive
    register(agents, Registration(TOOL, 1, "coding-agent", "bash-tool"))  # pid reused: 200
    register(agents, Registration(999, 5, "coding-agent", "bash-tool"))  # gone
    (agents / "12.json").write_text("garbage")
    removed = prune(agents, proc.root)
    assert sorted(p.name for p in removed) == ["12.json", "4343.json", "999.json"]
    assert [p.name for p in agents.iterdir()] == [f"{AGENT}.json"]
