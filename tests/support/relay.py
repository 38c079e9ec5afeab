"""A TCP relay that a test can switch off and on: a service going down and coming back with its
state intact (an OpenBao dev server keeps everything in memory, so restarting it would lose
every lease; stopping the relay in front of it does not)."""

from __future__ import annotations

import socket
import threading


class Relay:
    def __init__(self, listen_host: str, target: tuple[str, int], port: int = 0) -> None:
        self.listen_host = listen_host
        self.target = target
        self.port = port
        self._srv: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def addr(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    def start(self) -> Relay:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((self.listen_host, self.port))
        self.port = srv.getsockname()[1]
        srv.listen(64)
        self._srv = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Refuse new connections and cut the open ones (keep-alive included)."""
        srv, self._srv = self._srv, None
        if srv is not None:
            try:
                srv.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            srv.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                client, _ = srv.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
