"""The parser classes of the ``kvtier`` command line: one-line errors, each option's
default in its help, and what every command's parser shares."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import NoReturn

from .args import store_arg
from .common import UsageError


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + message
        raise UsageError(message)


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not (default is None or default is False or default in ([], "", argparse.SUPPRESS) or "default" in text):
            text += " (default: %(default)s)"
        return text


@dataclass
class Tree:
    """What every command's parser shares: ``-v`` after the subcommand, the epilog, the store's help."""

    common: argparse.ArgumentParser
    epilog: str
    store_help: str

    def command(self, parent, name: str, help: str) -> Parser:
        return parent.add_parser(
            name, help=help, description=help, parents=[self.common], formatter_class=Formatter, epilog=self.epilog
        )

    def store_flag(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--store", type=store_arg, default=None, metavar="STORE", help=self.store_help)
