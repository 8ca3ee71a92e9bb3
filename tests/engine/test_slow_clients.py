"""Connections that hold the server without sending a request are closed: no request
head at all, a head trickled a byte at a time, an idle kept-alive connection, a body
that never finishes (uvicorn in this process, on a free port of 127.0.0.1, with short
deadlines; the small generated model)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.engine.serve.draining import DrainingServer

HEAD_S, KEEP_ALIVE_S, BODY_S = 0.5, 1, 0.5
WAIT_S = 3.0  # well past every deadline above, and under uvicorn's default keep-alive of 5 s


@pytest.fixture(scope="module")
def port(loaded):
    server = KVTierServer(
        Engine(loaded, EngineConfig(page_size=16)), ServerConfig("kvtier-default", body_timeout_s=BODY_S)
    )
    server.start()
    uv = DrainingServer(server, 1.0, "warning", head_timeout=HEAD_S, keep_alive=KEEP_ALIVE_S)
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield sock.getsockname()[1]
    uv.should_exit = True
    thread.join(30)
    server.close()


def _connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.settimeout(WAIT_S)
    return conn


def _closed(conn: socket.socket) -> bool:
    """Whether the server closes the connection within WAIT_S (nothing more to read)."""
    try:
        return conn.recv(1 << 16) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _response(conn: socket.socket) -> tuple[int, bytes]:
    """One HTTP response: its status and body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(1 << 16)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += conn.recv(1 << 16)
    return int(head.split()[1]), body


def test_a_connection_that_sends_nothing_is_closed(port):
    with _connect(port) as conn:
        assert _closed(conn)


def test_a_head_trickled_on_a_kept_alive_connection_is_closed(port):
    with _connect(port) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(conn)[0] == 200
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        closed = False
        for _ in range(int(WAIT_S / 0.1)):  # a header byte every 0.1 s: more than keep-alive ever waits for
            try:
                conn.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.1)
        assert closed or _closed(conn)


def test_an_idle_kept_alive_connection_is_closed(port):
    with _connect(port) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = _response(conn)
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert _closed(conn)


def test_a_body_that_never_finishes_is_a_408(port):
    with _connect(port) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        conn.sendall(b"Content-Length: 100\r\n\r\n" + b'{"prompt": "')  # 88 bytes never come
        status, body = _response(conn)
    error = json.loads(body)["error"]
    assert status == 408 and error["code"] == "body_timeout" and "12 bytes came" in error["message"]
