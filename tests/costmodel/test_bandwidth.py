"""The measuring core of ``kvtier bench restore`` (costmodel.bandwidth)."""

import pytest

from kvtier.costmodel.bandwidth import Call, interleaved


def test_rounds_interleave_every_row_and_each_keeps_its_own_timings():
    order = []

    def call(name: str) -> Call:
        return Call(
            lambda: order.append(name), lambda: order.append(f"setup {name}"), lambda: order.append(f"teardown {name}")
        )

    calls = interleaved({"a": call("a"), "b": call("b"), "c": call("c")}, rounds=3)
    one_round = [f"{step}{name}" for name in "abc" for step in ("setup ", "", "teardown ")]
    assert order == one_round * 4  # the untimed warm-up round, then 3 timed ones
    for timed in calls.values():
        assert len(timed.seconds) == 3 and timed.best == min(timed.seconds) >= 0


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        interleaved({"a": Call(lambda: None)}, rounds=0)
