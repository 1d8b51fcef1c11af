"""A TCP proxy in front of a real Redis-protocol server (a Unix socket) that can delay what
clients send, or answer garbage itself: the slow and broken stores of the store-tier tests
and of `bench/bench_kv_store_slow.py`."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

GARBAGE = b":0\r\n"  # an integer reply, whatever was asked


class StoreProxy:
    """Listens on 127.0.0.1 (`url`); each connection is forwarded to `upstream` after
    `delay_s` per chunk the client sends, or, while `is_garbage`, answered `:0` per chunk."""

    def __init__(self, upstream: Path, delay_s: float = 0.0, is_garbage: bool = False) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self.is_garbage = is_garbage
        self.num_chunks = 0  # chunks clients sent (each a command or a pipeline, roughly)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = []
        self._is_closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"

    def _accept(self) -> None:
        while not self._is_closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server: socket.socket | None = None
        try:
            while chunk := client.recv(1 << 20):
                self.num_chunks += 1
                if self.is_garbage:
                    client.sendall(GARBAGE)
                    continue
                if self.delay_s:
                    time.sleep(self.delay_s)
                if server is None:
                    server = socket.socket(socket.AF_UNIX)
                    server.connect(str(self.upstream))
                    self._sockets.append(server)
                    threading.Thread(target=_pump, args=(server, client), daemon=True).start()
                server.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (client, server):
                if sock is not None:
                    sock.close()

    def close(self) -> None:
        self._is_closed = True
        self._listener.close()
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 20):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        try:
            sink.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
