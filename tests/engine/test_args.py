"""Sizes, durations and counts on the command line: what makes no sense is one line, exit 2."""

from __future__ import annotations

import argparse

import pytest

from kvtier.engine.cli import UsageError, build_parser

from .. import cli

REFUSED = [  # (argv, words of the one line)
    (["store", "resize", "--l3-bytes", "0"], "more than 0 bytes"),
    (["store", "resize", "--l3-bytes", "0B"], "more than 0 bytes"),
    (["serve", "--drain-timeout", "-5"], "0 seconds or more"),
    (["serve", "--drain-timeout", "inf"], "expected a number"),
    (["serve", "--drain-timeout", "soon"], "expected a number"),
    (["serve", "--flush-timeout", "0"], "more than 0"),
    (["serve", "--max-waiting", "0"], "positive whole number"),
    (["serve", "--max-running", "-1"], "positive whole number"),
    (["serve", "--max-tokens", "0"], "positive whole number"),
    (["replay", "t.jsonl", "--speed", "0"], "more than 0"),
    (["replay", "t.jsonl", "--speed", "-2"], "more than 0"),
    (["bench", "restore", "--rounds", "0"], "positive whole number"),
    (["bench", "ttft", "--lengths", "0,512"], "positive whole numbers"),
    (["run", "--prompt", "x", "--throttle", "L3=0MiB/s"], "must be positive"),
]


@pytest.mark.parametrize("argv, words", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_sizes_durations_and_counts_that_make_no_sense_are_refused(argv, words):
    with pytest.raises(UsageError) as caught:
        build_parser().parse_args(argv)
    message = str(caught.value)
    assert words in message and "\n" not in message


ACCEPTED = [  # where 0 means something: a tier that is off (an L3 that drops writes), no draining, no refresh
    (
        ["run", "--prompt", "x", "--l1-bytes", "0", "--l2-bytes", "0", "--l3-bytes", "0"],
        {"l1_bytes": 0, "l2_bytes": 0, "l3_bytes": 0},
    ),
    (["serve", "--drain-timeout", "0"], {"drain_timeout": 0.0}),
    (["serve", "--drain-timeout", "2.5", "--l3-bytes", "1MiB"], {"drain_timeout": 2.5, "l3_bytes": 1 << 20}),
    (["run", "--prompt", "x", "--refresh-window", "0"], {"refresh_window": 0}),
    (["replay", "t.jsonl", "--speed", "0.02"], {"speed": 0.02}),
]


@pytest.mark.parametrize("argv, values", ACCEPTED, ids=[" ".join(a) for a, _ in ACCEPTED])
def test_zero_is_taken_where_it_means_something(argv, values):
    args = vars(build_parser().parse_args(argv))
    assert {name: args[name] for name in values} == values


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:  # argparse has no public walk over its options
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        else:
            yield action


def test_no_flag_takes_a_bare_number():
    """``float`` takes -5, nan and inf; ``int`` takes -1: every number goes through a checking type."""
    bare = sorted({"/".join(a.option_strings) for a in _actions(build_parser()) if a.type in (int, float)})
    assert bare == []


@pytest.mark.parametrize("argv", [["store", "resize", "--l3-bytes", "0"], ["serve", "--drain-timeout", "-5"]])
def test_the_reported_cases_exit_2_with_one_line(argv):
    done = cli.run(argv)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("kvtier: error: ") and len(done.stderr.strip().splitlines()) == 1, done.stderr
