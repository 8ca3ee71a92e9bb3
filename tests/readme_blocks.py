"""The README's fenced code blocks, and a shell that runs them as written.

A block is found by the start of its first line, so a test names the block it runs
the way a reader sees it, and an edit of the README that changes a command breaks
the test that runs it instead of leaving it behind. Commands run under ``bash``
with only the substitutions of ``SUBSTITUTIONS`` applied, each one visible there
with its reason: what a reader's machine has and a test must not share (the venv,
a store in /tmp, fixed ports).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
README = CHECKOUT / "README.md"
BIN = Path(sys.executable).parent  # the venv running this test: what `.venv/bin/` is for a reader

# (as written in the README, as run here, why). Applied in order to every command
# and snippet the tests run; nothing else in them is changed.
SUBSTITUTIONS: list[tuple[str, str, str]] = [
    (".venv/bin/", f"{BIN}/", "the venv: the one running this test"),
    ("/tmp/kv", "{tmp}/kv", "a store of this test's own (/tmp is shared)"),
    ("--port 8000", "--port 0", "serve takes a free port and prints it; the clients below get that port"),
    ("localhost:8000", "localhost:{port}", "the port serve printed"),
    ("127.0.0.1:8000", "127.0.0.1:{port}", "the port serve printed"),
    ("--port 6379", "--port {redis_port} --bind 127.0.0.1", "a free port, on loopback only"),
    ("redis-host:6379", "127.0.0.1:{redis_port}", "the redis-server started by the test"),
    ("--host 0.0.0.0", "--host 127.0.0.1", "loopback only: the fleet's three engine hosts are this machine"),
    ("engine-1:8000", "127.0.0.1:{engine_1}", "the port the first engine printed"),
    ("engine-2:8000", "127.0.0.1:{engine_2}", "the port the second engine printed"),
    ("engine-3:8000", "127.0.0.1:{engine_3}", "the port the third engine printed"),
    ("--port 8080", "--port 0", "the router takes a free port and prints it"),
    ("localhost:8080", "localhost:{router_port}", "the port the router printed"),
]


@dataclass(frozen=True)
class Block:
    """One fenced block: its line in the README (1-based, the opening fence), its
    info string (``sh``, ``python``, ``json`` or empty for output) and its text."""

    line: int
    info: str
    text: str

    @property
    def first(self) -> str:
        return self.text.split("\n", 1)[0]

    def commands(self) -> list[str]:
        """The shell commands of an ``sh`` block: one per line, ``\\`` continuations
        joined, comment-only lines dropped (bash drops a trailing ``# ...`` itself)."""
        joined = self.text.replace("\\\n", "")
        return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block, by CommonMark's rule: a fence closes only on a line of at
    least as many backticks and nothing else (so an output that prints ```bash stays
    inside its block)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})([^`\s]*)\s*$", lines[i])
        if opening is None:
            i += 1
            continue
        fence, info, start, body = opening.group(1), opening.group(2), i + 1, []
        i += 1
        while i < len(lines) and not re.match(rf"^{fence}`*\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        found.append(Block(start, info, "\n".join(body)))
        i += 1
    return found


def block(prefix: str) -> Block:
    """The one block whose first line starts with ``prefix``."""
    matches = [b for b in blocks() if b.first.startswith(prefix)]
    assert len(matches) == 1, f"README: {len(matches)} blocks start with {prefix!r}"
    return matches[0]


def after(b: Block, chars: int = 1500) -> str:
    """The README text right after a block: where it says what the block prints."""
    text = README.read_text(encoding="utf-8")
    end = text.index(b.text) + len(b.text)
    return text[end : end + chars]


def as_run(text: str, **values: object) -> str:
    """``text`` with ``SUBSTITUTIONS`` applied and their ``{names}`` filled in."""
    for written, run, _ in SUBSTITUTIONS:
        if written in text:
            text = text.replace(written, run.format(**values))
    return text


class Shell:
    """Runs README commands with bash in ``cwd`` (a private directory that has the
    checkout's ``examples/``), with ``env``; ``values`` fill the substitutions."""

    def __init__(self, cwd: Path, env: dict[str, str], **values: object) -> None:
        self.cwd, self.env, self.values = cwd, env, dict(values)
        (cwd / "examples").symlink_to(CHECKOUT / "examples", target_is_directory=True)

    def run(self, command: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", as_run(command, **self.values)],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stderr[-3000:]}"
        return done

    def python(self, snippet: str, timeout: float = 300) -> str:
        """A Python snippet, run by this venv's interpreter; its stdout."""
        done = subprocess.run(
            [sys.executable, "-c", as_run(snippet, **self.values)],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        last = done.stderr.strip().splitlines()[-1:] or [""]
        assert done.returncode == 0, f"snippet failed: {last[0]}\n{done.stderr[-3000:]}"
        return done.stdout

    def start(self, command: str) -> Background:
        return Background(
            subprocess.Popen(
                ["bash", "-c", "exec " + as_run(command, **self.values)],
                cwd=self.cwd,
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )


class Background:
    """A server started from a README command: its stderr lines collected as they
    come (so a full pipe never blocks it), stopped with SIGTERM."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            assert self.proc.poll() is None, "exited early:\n" + "\n".join(self.lines[-20:])
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in {timeout} s:\n" + "\n".join(self.lines[-20:]))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def readme_env(home: Path, auto_calibrate: bool = False) -> dict[str, str]:
    """The environment of a reader: ``kvtier`` on PATH (the Redis example runs it
    bare), a private ``KVTIER_HOME``; without the quick calibration on first use of a
    store unless asked for (only the first run's output shows it, and one per new
    store would double this file's runtime; the claims checked hold on the defaults)."""
    env = dict(os.environ, KVTIER_HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("KVTIER_NO_AUTO_CALIBRATE", None)
    if not auto_calibrate:
        env["KVTIER_NO_AUTO_CALIBRATE"] = "1"
    return env


def normalized(text: str) -> list[str]:
    """Output lines compared with a README output block: runs of spaces made one
    (column widths follow the figures), timings masked (``ttft N ms``, a link's
    seconds and GiB/s), and the L3 cap of a new store (32 GiB, or half the free disk
    where that is less), trailing blank lines dropped."""
    out = []
    for line in text.rstrip("\n").split("\n"):
        line = re.sub(r"ttft \d+ ms", "ttft N ms", line)
        line = re.sub(r"^L3(\s+)\d+", r"L3\1CAP", line)
        line = re.sub(r"^(L\d->L\d\s+\d+\s+\d+)\s+[\d.]+\s+[\d.]+\s*$", r"\1 S G", line)
        out.append(re.sub(r" +", " ", line).rstrip())
    return out


def synopses(text: str) -> dict[str, set[str]]:
    """``kvtier COMMAND [SUB]`` -> the long flags its synopsis lines name."""
    found: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        if head := re.match(r"kvtier ((?:store |bench )?[a-z-]+)", line):
            current = head.group(1).strip()
            found.setdefault(current, set())
        if current:
            found[current] |= set(re.findall(r"--[a-z0-9-]+", line))
    return found
