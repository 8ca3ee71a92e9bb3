"""Ctrl-C (and SIGTERM) at each moment of ``kvtier run`` and ``kvtier serve``, in a real
child process: never a traceback, always the README's line and exit status.

Each moment is reached by waiting for what the process prints at it (a ``-v`` log
line, the calibration notice, a request's header, its first text), not by sleeping.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from .. import cli
from .conftest import on_tiny_model

pytestmark = pytest.mark.slow  # starts processes or loads the real model

LONG_PROMPT = "the prefill of a long prompt takes a while " * 250  # ~10,000 tokens (bytes): seconds of prefill
SHORT_PROMPT = "a short prompt " * 20
PAGE = "16"
INTERRUPTED = re.compile(r"kvtier: interrupted; (\d+) pages kept in (.+)")
STOPPED = re.compile(r"kvtier: stopped; (\d+) pages kept in (.+)")


class Child:
    """A ``kvtier`` process whose stdout and stderr are read as they come."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, module: str = "kvtier.engine.cli") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *on_tiny_model(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env or dict(os.environ),
            cwd=Path(__file__).parents[2],  # where ``tests`` is a package (``tests.engine.frozen_l3``)
        )
        self.out, self.err = bytearray(), bytearray()
        self.readers = [
            threading.Thread(target=self._read, args=(f, buf), daemon=True)
            for f, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, into: bytearray) -> None:
        while chunk := stream.read1(4096):
            into += chunk

    def wait_for(self, stream: str, pattern: str, timeout: float = 180) -> re.Match:
        """The first match of ``pattern`` in stdout or stderr, once the child has printed it."""
        deadline = time.monotonic() + timeout
        while (found := re.search(pattern, self.text(stream))) is None:
            assert self.proc.poll() is None or self.readers_alive(), (
                f"exited {self.proc.returncode} before {pattern!r}:\n{self.text('err')}"
            )
            assert time.monotonic() < deadline, f"no {pattern!r} in {timeout} s:\n{self.text(stream)}"
            time.sleep(0.01)
        return found

    def readers_alive(self) -> bool:
        return any(reader.is_alive() for reader in self.readers)

    def text(self, stream: str) -> str:
        return bytes(self.out if stream == "out" else self.err).decode(errors="replace")

    def signal_and_wait(self, sig: int = signal.SIGINT, timeout: float = 120) -> int:
        self.proc.send_signal(sig)
        return self.wait(timeout, f"signal {sig}")

    def wait(self, timeout: float = 120, after: str = "its start") -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running {timeout} s after {after}:\n{self.text('err')}") from None
        for reader in self.readers:
            reader.join(10)
        return code


def store_pages(store: Path) -> int:
    done = cli.run(["stats", "--json", "--store", str(store)])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["tiers"]["L3"]["pages"]


def assert_interrupted(child: Child, code: int, store: Path) -> None:
    """Exit 130, no traceback, and the last stderr line names what the store really holds."""
    err = child.text("err")
    assert "Traceback" not in err and "Exception" not in err, err
    assert code == 130, err
    last = err.strip().splitlines()[-1]
    assert (found := INTERRUPTED.fullmatch(last)), err
    assert found.group(2) == str(store)
    assert int(found.group(1)) == (store_pages(store) if (store / "data.mdb").exists() else 0)


def env_with(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


# -- run ---------------------------------------------------------------------------


def run_args(store: Path, prompt: str, max_tokens: int) -> list[str]:
    return [
        "run",
        "-v",
        "--store",
        str(store),
        "--page-size",
        PAGE,
        "--max-tokens",
        str(max_tokens),
        "--prompt",
        prompt,
    ]


def test_ctrl_c_while_the_model_loads(tmp_path):
    child = Child(run_args(tmp_path, SHORT_PROMPT, 4))
    child.wait_for("err", "BLAS: ")  # logged just before the model is loaded
    assert_interrupted(child, child.signal_and_wait(), tmp_path)


def test_ctrl_c_while_calibrating_a_new_store(tmp_path):
    child = Child(run_args(tmp_path, SHORT_PROMPT, 4), env=env_with(KVTIER_NO_AUTO_CALIBRATE=None))
    child.wait_for("err", "a quick calibration first")
    assert_interrupted(child, child.signal_and_wait(), tmp_path)
    assert not list(tmp_path.glob("calibration-*")), "the calibration's scratch store must be removed"


def test_ctrl_c_out_of_an_exec_string_still_exits_130(tmp_path):
    """The calibration's first use builds dataclasses and namedtuples, whose methods come
    from ``exec`` of a string: a Ctrl-C landing there must not end ``python -m`` by SIGINT."""
    child = Child(["stats", "--store", str(tmp_path)], module="tests.engine.interrupt_in_exec")
    assert_interrupted(child, child.wait(), tmp_path)  # the interrupt comes from inside


def test_ctrl_c_before_the_first_token(tmp_path):
    child = Child(run_args(tmp_path, LONG_PROMPT, 4))
    child.wait_for("out", r"── request 0: \d+ prompt tokens\n")  # submitted; its prefill takes seconds
    assert_interrupted(child, child.signal_and_wait(), tmp_path)


def test_ctrl_c_mid_generation_keeps_the_prompts_pages(tmp_path):
    child = Child(run_args(tmp_path, SHORT_PROMPT, 20000))
    child.wait_for("out", r"── request 0: \d+ prompt tokens\n[\s\S]{8}")  # text is streaming
    assert_interrupted(child, child.signal_and_wait(), tmp_path)
    assert store_pages(tmp_path) > 0


def test_ctrl_c_at_the_end(tmp_path):
    """After the last token: while the store closes, or as the summary prints, or once the
    process has finished (then it exits 0 with its summary)."""
    child = Child(run_args(tmp_path, SHORT_PROMPT, 4))
    child.wait_for("out", r"   ttft \d+ ms")
    code = child.signal_and_wait()
    if code == 0:
        assert "Traceback" not in child.text("err") and "cost model" in child.text("out")
    else:
        assert_interrupted(child, code, tmp_path)


# -- serve -------------------------------------------------------------------------


def serve_args(store: Path, *flags: str) -> list[str]:
    return ["serve", "--port", "0", "--store", str(store), "--page-size", PAGE, *flags]


def assert_stopped(child: Child, code: int, store: Path) -> None:
    """Exit 0, no traceback, and a last line naming the pages the store holds after the flush."""
    err = child.text("err")
    assert "Traceback" not in err and "Exception" not in err, err
    assert code == 0, err
    assert (found := STOPPED.fullmatch(err.strip().splitlines()[-1])), err
    assert found.group(2) == str(store) and int(found.group(1)) == store_pages(store)


def test_ctrl_c_before_the_server_serves(tmp_path):
    child = Child([*serve_args(tmp_path), "-v"])
    child.wait_for("err", "BLAS: ")
    assert_interrupted(child, child.signal_and_wait(), tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_an_idle_server(tmp_path, sig):
    """It stops, and the store keeps the counters of what it served (``kvtier stats``)."""
    child = Child(serve_args(tmp_path))
    url = child.wait_for("err", r"on (http://\S+)\n").group(1)
    assert httpx.get(url + "/health", timeout=60).json()["status"] == "ok"
    served = httpx.post(url + "/v1/completions", json={"prompt": SHORT_PROMPT, "max_tokens": 2}, timeout=60).json()
    assert_stopped(child, child.signal_and_wait(sig), tmp_path)
    done = cli.run(["stats", "--json", "--store", str(tmp_path)])
    counted = json.loads(done.stdout)["engine"]
    assert (counted["requests"], counted["prompt_tokens"]) == (1, served["usage"]["prompt_tokens"])


def test_ctrl_c_with_a_request_in_flight_drains_and_flushes(tmp_path):
    child = Child(serve_args(tmp_path, "--drain-timeout", "1"))
    url = child.wait_for("err", r"on (http://\S+)\n").group(1)
    body = {"prompt": SHORT_PROMPT, "max_tokens": 20000, "stream": True}
    lines, opened = [], threading.Event()

    def read() -> None:  # a client reading its stream as it comes
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    opened.set()
        except httpx.HTTPError as err:
            lines.append(f"client: {err!r}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert opened.wait(120), "the stream never opened"  # the request is in flight
    code = child.signal_and_wait()
    reader.join(60)
    rest = [line for line in lines if line]  # after the drain timeout: an error event, the end
    assert "shutting down" in rest[-2] and rest[-1] == "data: [DONE]", (rest[-3:], child.text("err"))
    assert_stopped(child, code, tmp_path)
    assert store_pages(tmp_path) > 0, "the prompt's pages were flushed to L3"


UNFLUSHED = re.compile(
    r"kvtier: stopped without a full flush: (\d+) pages not written to L3 within --flush-timeout 2 s "
    r"\(the store did not answer\); what it committed is intact"
)


def test_sigterm_with_a_frozen_store_exits_within_the_flush_timeout(tmp_path):
    """The store's writes freeze (``frozen_l3``) while a served prompt's pages are in L1
    only: SIGTERM flushes for ``--flush-timeout`` seconds, then exits 1 with one line
    naming the pages not written; the store opens afterwards, holding what an earlier
    run committed and nothing half-written."""
    store, flag = tmp_path / "store", tmp_path / "frozen"
    ran = cli.run(
        on_tiny_model(["run", "--store", store, "--page-size", PAGE, "--max-tokens", "1", "--prompt", SHORT_PROMPT])
    )
    assert ran.returncode == 0, ran.stderr
    committed = store_pages(store)
    child = Child(
        serve_args(store, "--flush-timeout", "2"), env_with(KVTIER_TEST_FREEZE=str(flag)), "tests.engine.frozen_l3"
    )
    url = child.wait_for("err", r"on (http://\S+)\n").group(1)
    flag.touch()  # from now on every write of the store waits
    prompt = ("another prompt, not in the store yet " * 3)[:100]  # 100 bytes: 6 full pages, with its answer too
    usage = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60).json()["usage"]
    t0 = time.monotonic()
    code = child.signal_and_wait(signal.SIGTERM, timeout=30)
    took = time.monotonic() - t0
    err = child.text("err")
    assert code == 1 and "Traceback" not in err, err
    assert (found := UNFLUSHED.fullmatch(err.strip().splitlines()[-1])), err
    assert int(found.group(1)) == usage["prompt_tokens"] // int(PAGE) == 6
    assert took < 2 + 10, f"{took:.1f} s from SIGTERM to exit"  # the flush timeout, and the process's own end
    assert store_pages(store) == committed > 0  # it opens, and holds what was committed before


# -- the pieces --------------------------------------------------------------------


def test_a_ctrl_c_while_the_store_closes_is_raised_once_the_close_is_done():
    from kvtier.engine.interrupts import deferred_interrupt

    finished = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, in the block: it must not raise
            finished.append(True)
    assert finished == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# A serving engine on the small model that checkpoints its counters every 0.2 s: it
# prints the prompt's length once its one request is done, then waits to be killed.
_SERVING = """
import sys, time
import kvtier
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.load import load_model
from kvtier.tiers.hierarchy import StoreConfig
config = EngineConfig(page_size=16, store=StoreConfig(store_dir=sys.argv[1]), counters_every_s=0.2)
engine = Engine(load_model("kvtier-tiny"), config)
engine.start()
request = engine.submit(sys.argv[2])
for _ in request.stream():
    pass
print(len(request.prompt), flush=True)
time.sleep(600)
"""


def test_a_killed_servers_counters_reach_the_store_while_it_runs(tmp_path):
    """SIGKILL skips every flush: what the store knows of the process is what its
    checkpoints wrote while it ran (``tiers.checkpoints``)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _SERVING, str(tmp_path), SHORT_PROMPT], stdout=subprocess.PIPE, text=True
    )
    try:
        line = child.stdout.readline()
        assert line, "the serving engine exited before its request was done"
        deadline = time.monotonic() + 60
        while (counted := _engine_counters(tmp_path)).get("requests") != 1:
            assert time.monotonic() < deadline, f"no checkpoint of the request in 60 s: {counted}"
            time.sleep(0.2)
    finally:
        child.kill()
        child.wait(60)
    assert _engine_counters(tmp_path) == {**counted, "requests": 1, "prompt_tokens": int(line)}


def _engine_counters(store: Path) -> dict:
    done = cli.run(["stats", "--json", "--store", str(store)])
    return json.loads(done.stdout).get("engine", {}) if done.returncode == 0 else {}
