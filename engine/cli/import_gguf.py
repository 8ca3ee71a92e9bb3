"""``kvtier import-gguf``: convert a GGUF file for mlx-lm."""

from __future__ import annotations

import argparse

from .common import ProgressBar, UsageError


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from ..models.gguf import GGUFError, import_gguf

    with ProgressBar(f"importing {args.file.name}") as bar:
        try:
            out = import_gguf(args.file, args.out, args.dtype, bar.update)
        except GGUFError as err:
            raise UsageError(str(err)) from None
    print(out)
    return 0
