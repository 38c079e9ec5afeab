"""Debian's rsyslogd as a real syslog collector: imtcp (plain, or TLS with the gtls driver),
every message it receives written to a file, raw as received and as rsyslog parsed it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

RSYSLOGD = shutil.which("rsyslogd") or "/usr/sbin/rsyslogd"


class Rsyslog:
    def __init__(self, workdir: Path, host: str, port: int, *, cert: Path | None = None,
                 key: Path | None = None, ca: Path | None = None) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.host, self.port = host, port
        self.raw = self.dir / "raw.log"  # the message as received (framing removed)
        self.parsed = self.dir / "parsed.log"  # APP-NAME|MSGID|STRUCTURED-DATA, as rsyslog read
        self.json = self.dir / "json.log"  # the MSG, as docs/audit-export.md's template writes it
        tls = ""
        driver = ""
        if cert is not None:
            tls = (f'  DefaultNetstreamDriverCAFile="{ca}"\n'
                   f'  DefaultNetstreamDriverCertFile="{cert}"\n'
                   f'  DefaultNetstreamDriverKeyFile="{key}"\n'
                   '  DefaultNetstreamDriver="gtls"\n')
            driver = ' StreamDriver.Name="gtls" StreamDriver.Mode="1" StreamDriver.AuthMode="anon"'
        self.conf = self.dir / "rsyslog.conf"
        self.conf.write_text(
            "global(\n"
            f'  workDirectory="{self.dir}"\n'
            '  maxMessageSize="256k"\n'
            '  net.enableDNS="off"\n'
            f"{tls})\n"
            f'module(load="imtcp"{driver})\n'
            f'input(type="imtcp" address="{host}" port="{port}")\n'
            'template(name="raw" type="string" string="%rawmsg%\\n")\n'
            'template(name="parsed" type="string" '
            'string="%app-name%|%msgid%|%structured-data%\\n")\n'
            # docs/audit-export.md's template: the MSG without its BOM, one JSON object a line
            'template(name="json" type="string" string="%msg:4:$%\\n")\n'
            f'*.* action(type="omfile" file="{self.json}" template="json")\n'
            f'*.* action(type="omfile" file="{self.raw}" template="raw")\n'
            f'*.* action(type="omfile" file="{self.parsed}" template="parsed")\n')
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20) -> Rsyslog:
        check = subprocess.run([RSYSLOGD, "-N1", "-f", str(self.conf)], capture_output=True,
                               text=True)
        if check.returncode != 0:
            raise RuntimeError(f"rsyslog config invalid:\n{check.stderr}{check.stdout}")
        log = (self.dir / "rsyslogd.out").open("wb")
        self.proc = subprocess.Popen([RSYSLOGD, "-n", "-f", str(self.conf),
                                      "-i", str(self.dir / "rsyslogd.pid")],
                                     stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("rsyslogd exited: "
                                   + (self.dir / "rsyslogd.out").read_text(errors="replace"))
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("rsyslogd did not listen")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    def lines(self, which: str = "raw") -> list[str]:
        path = {"raw": self.raw, "parsed": self.parsed, "json": self.json}[which]
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def wait_for(self, needle: str, timeout: float = 15) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines():
                if needle in line:
                    return line
            time.sleep(0.05)
        raise AssertionError(f"rsyslog received no message with {needle!r}: {self.lines()}")
