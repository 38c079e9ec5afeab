"""An upstream that accepts TCP and resets every connection (SO_LINGER 0 close): a dying server.

At once, or `delay` seconds after accepting. Used by the soak tests' "hangup" fault and by
tests/integration/test_upstream_reset.py.
"""

from __future__ import annotations

import socket
import struct
import threading
import time


class HangUp:
    def __init__(self, ip: str, port: int = 443, delay: float = 0.0) -> None:
        self.delay = delay
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, port))
        self.sock.listen(128)
        self.sock.settimeout(0.1)
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            if self.delay:
                time.sleep(self.delay)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close()
