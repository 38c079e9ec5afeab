"""Arize Phoenix as a real OpenTelemetry collector: its OTLP/HTTP endpoint takes the spans,
its REST API (/v1/projects/default/spans) answers what it stored. It runs from its own venv
(.venv-phoenix, scripts/setup.sh --test): its dependencies are many and pinned apart from ours."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PHOENIX = ROOT / ".venv-phoenix" / "bin" / "phoenix"


class Phoenix:
    def __init__(self, workdir: Path, host: str, port: int = 6006, grpc_port: int = 4317) -> None:
        self.dir = workdir
        self.host, self.port, self.grpc_port = host, port, grpc_port
        self.proc: subprocess.Popen[bytes] | None = None
        self._up = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 90) -> Phoenix:
        return self.launch().ready(timeout)

    def launch(self) -> Phoenix:
        """Start the process without waiting (its ~15 s start overlaps the other fixtures':
        spans sent meanwhile wait in the exporter's queue and retries)."""
        if not PHOENIX.exists():
            raise RuntimeError(f"{PHOENIX} missing: run scripts/setup.sh --test")
        env = {**os.environ, "PHOENIX_HOST": self.host, "PHOENIX_PORT": str(self.port),
               "PHOENIX_GRPC_PORT": str(self.grpc_port), "PHOENIX_WORKING_DIR": str(self.dir),
               "PHOENIX_TELEMETRY_ENABLED": "false"}
        log = (self.dir / "phoenix.out").open("wb")
        self.proc = subprocess.Popen([str(PHOENIX), "serve"], env=env, stdout=log,
                                     stderr=subprocess.STDOUT)
        return self

    def ready(self, timeout: float = 90) -> Phoenix:
        assert self.proc is not None
        if self._up:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("phoenix exited: " + self.logs()[-3000:])
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as r:
                    if r.status == 200:
                        self._up = True
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("phoenix did not come up: " + self.logs()[-3000:])

    def logs(self) -> str:
        return (self.dir / "phoenix.out").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    def spans(self, trace_id: str | None = None) -> list[dict[str, Any]]:
        self.ready()
        query = "limit=1000" + (f"&trace_id={trace_id}" if trace_id else "")
        with urllib.request.urlopen(f"{self.url}/v1/projects/default/spans?{query}",
                                    timeout=10) as r:
            return list(json.load(r)["data"])

    def raw(self) -> bytes:
        """Everything Phoenix stored of the project's spans, as its API answers it."""
        self.ready()
        with urllib.request.urlopen(f"{self.url}/v1/projects/default/spans?limit=1000",
                                    timeout=10) as r:
            return r.read()

    def wait_spans(self, trace_id: str, n: int, timeout: float = 20) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        got: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            got = self.spans(trace_id)
            if len(got) >= n:
                return got
            time.sleep(0.2)
        raise AssertionError(f"phoenix has {len(got)} span(s) of trace {trace_id}, not {n}")
