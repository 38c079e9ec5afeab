"""A GateState for unit tests of the WebSocket call layers (stages/wsrpc, stages/wsllm): a
policy, its audit file, the answers injected to the client, and mitmproxy WebSocket flows
driven through the scrub stage's hooks as the gate addon drives them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from mitmproxy.test import tflow

from sandgate.decision import decide
from sandgate.policy.model import Policy
from sandgate.request import RequestInfo


@dataclass
class Gate:
    """A GateState with a policy, its audit file, and the answers it injected."""

    st: Any
    audit_path: Path
    injected: list[bytes]


def make_gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: Policy,
              layer: ModuleType) -> Gate:
    """A gate for `policy` (Vault unreachable: nothing here fetches a secret), whose
    injections to the client through `layer.inject_to_client` are kept in `Gate.injected`."""
    from sandgate.audit import events as audit
    from sandgate.identity.resolve import Identifier
    from sandgate.secrets.vault import SecretBroker, VaultConfig
    from sandgate.stages import context

    broker = SecretBroker(VaultConfig(addr="http://127.0.0.1:9", token="x", role_id=None,
                                      secret_id=None, cacert=None, namespace=None),
                          policy.secrets)
    st_ = context.GateState(context.GateConfig(
        policy=policy, broker=broker, identifier=Identifier(b"k" * 32),
        audit=audit.AuditLog(tmp_path / "audit.jsonl"), max_request_body=1000))
    injected: list[bytes] = []
    monkeypatch.setattr(layer, "inject_to_client", lambda flow, text: injected.append(text))
    return Gate(st_, tmp_path / "audit.jsonl", injected)


def ws_flow(gate: Gate, info: RequestInfo, *, calls: bool = False) -> Any:
    """A WebSocket flow whose upgrade `info` was decided for identity "agent" and started;
    `calls`: the upgrade's rule judges JSON-RPC calls (its CallState is set, as s35 does)."""
    from sandgate.identity.base import Caller
    from sandgate.stages import context, s70_scrub
    from sandgate.stages.flow import CallState

    flow = tflow.twebsocketflow()
    flow.websocket.messages.clear()
    rec = context.record(flow)
    rec.caller = Caller("agent", None, "token")
    rec.info = info
    rec.decision = decide(gate.st.flow_policy(rec), "agent", info)
    if calls:
        rec.call = CallState(gate.st.flow_policy(rec), "agent", info)
    s70_scrub.websocket_start(gate.st, flow, rec)
    return flow


def hook(gate: Gate, flow: Any, content: bytes, from_client: bool = True,
         text: bool = True) -> Any:
    """One message through the websocket_message hook; the message, as the hook left it."""
    from mitmproxy.websocket import WebSocketMessage
    from wsproto.frame_protocol import Opcode

    from sandgate.stages import context, s70_scrub

    msg = WebSocketMessage(Opcode.TEXT if text else Opcode.BINARY, from_client, content)
    flow.websocket.messages.append(msg)
    s70_scrub.websocket_message(gate.st, flow, context.record(flow))
    return msg


def audited(gate: Gate) -> list[dict[str, Any]]:
    """The `websocket` events the gate audited."""
    lines = gate.audit_path.read_text().splitlines() if gate.audit_path.exists() else []
    return [e for e in map(json.loads, lines) if e.get("event") == "websocket"]


def break_audit(gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit log fails from now on, as a full disk makes it: each write raises, and the
    log says it is unhealthy."""
    log = gate.st.cfg.audit

    def full(*args: Any, **kwargs: Any) -> None:
        log.healthy = False
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(log, "emit", full)
