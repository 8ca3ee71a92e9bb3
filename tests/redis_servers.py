"""Redis servers for tests: each one a ``redis-server`` of its own on a free loopback
port, its files in a temp dir, stopped (and its files removed) by the fixture."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed (.ci/run installs it)")


def free_port() -> int:
    """A free loopback port below 55536: a cluster node also listens on port + 10000."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) < 55536:
                return port


def _wait_until(ready, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up")
        time.sleep(0.02)


class RedisServer:
    """One redis-server process; ``stop`` then ``start`` brings it back, empty, on the same port."""

    def __init__(self, directory: Path, *args: str, tls: bool = False) -> None:
        self.directory, self.args, self.tls = directory, args, tls
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}?ssl_cert_reqs=none" if self.tls else f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, ssl=self.tls, ssl_cert_reqs="none")

    def start(self) -> None:
        ports = ["--port", str(self.port)]
        if self.tls:  # a self-signed certificate, made once per server
            cert, key = self.directory / "cert.pem", self.directory / "key.pem"
            if not cert.exists():
                subprocess.run(
                    [
                        "openssl",
                        "req",
                        "-x509",
                        "-newkey",
                        "rsa:2048",
                        "-nodes",
                        "-keyout",
                        str(key),
                        "-out",
                        str(cert),
                        "-days",
                        "1",
                        "-subj",
                        "/CN=127.0.0.1",
                    ],
                    check=True,
                    capture_output=True,
                    timeout=30,
                )
            ports = [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(cert),
                "--tls-key-file",
                str(key),
                "--tls-ca-cert-file",
                str(cert),
                "--tls-auth-clients",
                "no",
            ]
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                *ports,
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--save",
                "",
                "--appendonly",
                "no",
                "--loglevel",
                "warning",
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_until(self._answers, f"redis-server on port {self.port}")

    def _answers(self) -> bool:
        try:
            with self.client() as c:
                return bool(c.ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


class RedisCluster:
    """Three masters, no replicas: the smallest Redis Cluster."""

    def __init__(self, directory: Path, *args: str) -> None:
        self.nodes = []
        for i in range(3):
            (directory / str(i)).mkdir()
            self.nodes.append(
                RedisServer(
                    directory / str(i),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    *args,
                )
            )
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        _wait_until(self._ok, "the cluster")

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def _ok(self) -> bool:
        for node in self.nodes:
            with node.client() as c:
                info = c.execute_command("CLUSTER INFO")
            state = info.get("cluster_state") if isinstance(info, dict) else None
            if state != "ok" and "cluster_state:ok" not in str(info):
                return False
        return True

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class SlowProxy:
    """A TCP forwarder that holds every request ``delay`` seconds before passing it on:
    a Redis across a slow network. ``round_trips`` counts the requests it passed on (each
    read from a client: a pipeline's commands go in one write, so they count once)."""

    def __init__(self, port: int, delay: float = 0.0) -> None:
        self.target, self.delay = port, delay
        self.round_trips = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}?socket_timeout=10"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, server, self.delay, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, 0.0, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, delay: float, requests: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                self.round_trips += requests
                time.sleep(delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self.listener.close()


def _running(make, prefix: str):
    """A server (or cluster) made in a temp directory, stopped and removed after the test."""
    with tempfile.TemporaryDirectory(prefix=prefix) as directory:
        server = make(Path(directory))
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def redis_server():
    yield from _running(
        lambda d: RedisServer(d, "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"), "kvtier-redis-"
    )


@pytest.fixture
def redis_tls_server():
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test certificate)")
    yield from _running(
        lambda d: RedisServer(d, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", tls=True),
        "kvtier-redis-tls-",
    )


@pytest.fixture
def redis_cluster():
    yield from _running(
        lambda d: RedisCluster(d, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"), "kvtier-redis-cluster-"
    )
