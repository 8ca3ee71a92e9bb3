"""The ``kvtier`` command line for tests: in this process, or as a process of its own.

``run`` calls the CLI's ``main`` with the same argv, environment, stdin and working
directory a child would get and returns what a child returns (exit status, stdout,
stderr), without starting an interpreter: a child spends most of its time importing
mlx-lm and transformers before it reads its first argument, and most tests are about
what the command does, not about the process. ``run_process`` starts a real child for
the tests that are about the process: signals, kills, concurrent processes, what an
interpreter loads before kvtier (BLAS), a fresh import.

In this process, the logging configuration ``main`` sets up (a handler on stderr) and
the signal dispositions it changes are put back after each call; stderr holds what
Python code writes to ``sys.stderr`` (C libraries' own writes to fd 2 do not land there).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from kvtier.engine.cli.main import main

_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGPIPE, signal.SIGTERM) if hasattr(signal, s.name))


def run(
    args: Sequence[str],
    stdin: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
) -> subprocess.CompletedProcess:
    """``kvtier ARGS`` in this process: its exit status, stdout and stderr."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with _saved_process_state(), _environment(env), _cwd(cwd):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _stdin(stdin):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse's errors and --help
                code = _exit_status(exit_, err)
    return subprocess.CompletedProcess(["kvtier", *argv], code, out.getvalue(), err.getvalue())


def run_process(
    args: Sequence[str],
    stdin: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``kvtier ARGS`` as a child process (``python -m kvtier.engine.cli``)."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier.engine.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
        env=None if env is None else dict(env),
        cwd=cwd,
    )


def _exit_status(exit_: SystemExit, err: io.StringIO) -> int:
    if exit_.code is None or isinstance(exit_.code, int):
        return exit_.code or 0
    print(exit_.code, file=err)  # sys.exit("message"), as the interpreter does
    return 1


@contextlib.contextmanager
def _saved_process_state() -> Iterator[None]:
    """The root logger's handlers and level, and signal dispositions, as they were."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    dispositions = {s: signal.getsignal(s) for s in _SIGNALS}
    root.handlers = []  # so main's logging.basicConfig writes to this call's stderr
    try:
        yield
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers, root.level = handlers, level
        for s, disposition in dispositions.items():
            signal.signal(s, disposition)


@contextlib.contextmanager
def _environment(env: Mapping[str, str] | None) -> Iterator[None]:
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _stdin(text: str | None) -> Iterator[None]:
    saved = sys.stdin
    sys.stdin = io.StringIO(text or "")
    try:
        yield
    finally:
        sys.stdin = saved


@contextlib.contextmanager
def _cwd(path: Path | str | None) -> Iterator[None]:
    saved = Path.cwd()
    os.chdir(path or saved)
    try:
        yield
    finally:
        os.chdir(saved)
