"""``kvtier ARGS`` whose Ctrl-C surfaces out of code run by ``exec`` of a string, as one
landing while a dataclass or namedtuple is being built does (their methods are made so).
CPython then flags the interrupt as unhandled, even once ``main`` has caught it, and
under ``python -m`` ends the process by SIGINT instead of its exit status unless the
flag is cleared. A test runs it as ``python -m tests.engine.interrupt_in_exec stats ...``."""

from __future__ import annotations

import logging
import sys

from kvtier.engine.cli.main import main


def interrupted_in_exec(**kwargs: object) -> None:
    exec("raise KeyboardInterrupt")


logging.basicConfig = interrupted_in_exec  # called by main once the arguments are parsed

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
