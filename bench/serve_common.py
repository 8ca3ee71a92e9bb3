"""What the serve benchmarks share: start a server process, stream a chat request and
time its first token, read a process's resident memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Server:
    name: str
    cmd: list[str]
    url: str
    model: str | None  # what requests send as "model" (None: the id the server lists)
    proc: subprocess.Popen | None = None
    log: Path | None = None

    def start(self, timeout: float = 300) -> Server:
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{self.name}-{os.getpid()}.log"
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                models = httpx.get(self.url + "/v1/models", timeout=2)
                if models.status_code == 200:
                    self.model = self.model or models.json()["data"][0]["id"]
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start in {timeout} s")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def kvtier_server(model: str | None, port: int, store: Path, *flags: str) -> Server:
    cmd = [sys.executable, "-m", "kvtier.engine.cli", "serve", "--port", str(port), "--store", str(store), *flags]
    if model:
        cmd += ["--model", model]
    return Server("kvtier", cmd, f"http://127.0.0.1:{port}", model)


# mlx_lm.server with the BLAS kvtier uses: ``import kvtier`` preloads the system OpenBLAS
# (a much faster prefill on Linux CPUs than mlx's bundled BLAS), so neither side is handicapped.
_MLX_LM_SERVER = (
    "import kvtier, runpy, sys; sys.argv[0] = 'mlx_lm.server'; runpy.run_module('mlx_lm.server', run_name='__main__')"
)


def mlx_lm_server(model: str, port: int) -> Server:
    cmd = [sys.executable, "-c", _MLX_LM_SERVER, "--model", model, "--port", str(port), "--log-level", "WARNING"]
    return Server("mlx_lm.server", cmd, f"http://127.0.0.1:{port}", model)


@dataclass
class Reply:
    text: str
    ttft_s: float
    total_s: float
    tokens: int
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    backend: str | None = None  # the x-kvtier-backend of an answer through kvtier route


def stream_chat(client: httpx.Client, server: Server, messages: list[dict], max_tokens: int) -> Reply:
    """One streamed greedy chat request; TTFT is the time to the first chunk with text."""
    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, pieces, usage, finish = None, [], {}, None
    with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        backend = response.headers.get("x-kvtier-backend")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
                text = (choice.get("delta") or {}).get("content") or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                pieces.append(text)
    total = time.perf_counter() - t0
    return Reply(
        "".join(pieces),
        ttft if ttft is not None else total,
        total,
        usage.get("completion_tokens", 0),
        finish,
        usage,
        backend,
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def default_model_dir() -> str:
    """The directory of kvtier's default model (what ``--model`` omitted loads), for mlx_lm.server too."""
    from kvtier.engine.models.load import resolve_model_path

    return str(resolve_model_path(None))
