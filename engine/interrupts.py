"""How ``kvtier run`` and ``kvtier serve`` end on Ctrl-C and SIGTERM (README "Flags", "Serve").

``run``: Ctrl-C at any moment raises ``KeyboardInterrupt`` in the main thread; the
command cancels what is running, closes the engine (which flushes L1 and L2 to L3)
and ``main`` prints ``kvtier: interrupted; N pages kept in DIR`` and returns 130. A
Ctrl-C that arrives while the store is being closed is held until the close is done
(:func:`deferred_interrupt`), so a flush is never cut short and no Ctrl-C is lost.

``serve``: from the moment the engine exists, SIGINT and SIGTERM are a graceful stop
of the uvicorn server (:func:`stop_on_signals`), also when they arrive before uvicorn
runs or after it has shut down; before that (model load, calibration) Ctrl-C ends the
command as it ends ``run``.

These install signal handlers, so they must run on the main thread.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Inside the block Ctrl-C is recorded instead of raised; if one came, it is raised
    as ``KeyboardInterrupt`` when the block has finished. Where Ctrl-C raises nothing
    anyway (``serve`` once :func:`stop_on_signals` took it), the block runs as it is."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda sig, frame: caught.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


@contextmanager
def ignored_interrupts() -> Iterator[None]:
    """Ctrl-C does nothing inside the block: for the last words of a command that is
    already ending because of one."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_on_signals(server: uvicorn.Server) -> None:
    """SIGINT and SIGTERM stop ``server`` gracefully from now on.

    uvicorn installs its own handlers while it runs and, once it has shut down,
    restores these and raises each signal it caught again; a signal that came before
    it ran has already asked it to stop (it starts, then shuts down at once). Either
    way no signal is lost and none interrupts the store's flush after it.
    """
    for sig in _STOP_SIGNALS:
        signal.signal(sig, server.handle_exit)
