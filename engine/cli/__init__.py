"""``kvtier`` command line (DESIGN §8): the parser and dispatch (main), one module per
command or command group, the argument types (args) and what people read (output,
report, bench_report). Library code logs; only this package prints."""

from .common import UsageError
from .main import build_parser, main

__all__ = ["UsageError", "build_parser", "main"]
