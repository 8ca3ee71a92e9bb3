"""The measuring core of ``kvtier bench restore`` (costmodel.bandwidth)."""

import pytest

from kvtier.costmodel.bandwidth import Call, interleaved, measure

from ..tiers.small_pages import GEOMETRY


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


@pytest.mark.parametrize("encrypted", [False, True])
def test_encrypted_restores_are_a_row_of_their_own_compared_with_plain_ones(tmp_path, encrypted):
    """``kvtier bench restore --encrypt-l3``: restores of encrypted L3 pages, timed in the
    same rounds as the plain ones, their cost a ratio of the two; no link sample."""
    report = measure(GEOMETRY, tmp_path, (1, 2), rounds=1, encrypted=encrypted)
    rows = {(r["row"], r["pages"]): r for r in report["restores"]}
    assert (("L3 aes->L1", 2) in rows) == encrypted and ("encryption" in report) == encrypted
    assert {link["link"] for link in report["links"]} == {"L2->L1", "L3->L1", "L3->L2"}
    for cost in report.get("encryption", ()):
        plain, sealed = rows["L3->L1", cost["pages"]]["seconds"], rows["L3 aes->L1", cost["pages"]]["seconds"]
        assert (cost["plain_seconds"], cost["encrypted_seconds"]) == (plain, sealed)
        assert cost["ratio"] == sealed / plain
        assert cost["stored_bytes"] > cost["pages"] * GEOMETRY.nbytes  # decrypted from records a little larger
    assert [c["pages"] for c in report.get("encryption", ())] == ([1, 2] if encrypted else [])
    assert not list(tmp_path.iterdir()), "the scratch stores must be removed"
