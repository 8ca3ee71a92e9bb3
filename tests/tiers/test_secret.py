"""The server secret: created once, owner-only, the same for every opener."""

import stat
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.tiers.l3.base import StoreError
from kvtier.tiers.l3.secret import SECRET_BYTES, derive, read_or_create


def test_created_once_owner_only_and_shared(tmp_path):
    path = tmp_path / "store" / "secret"
    first = read_or_create(path)
    assert len(first) == SECRET_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_or_create(path) == first  # a second opener gets the same secret
    assert read_or_create(tmp_path / "other") != first


def test_a_damaged_secret_is_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"short")
    with pytest.raises(StoreError, match="holds 5 bytes"):
        read_or_create(path)


def test_derived_keys_depend_on_secret_purpose_and_parts():
    a, b = bytes(32), bytes([1]) * 32
    key = derive(a, b"tenant", b"alice")
    assert len(key) == 32
    assert key == derive(a, b"tenant", b"alice")
    others = derive(b, b"tenant", b"alice"), derive(a, b"encrypt", b"alice"), derive(a, b"tenant", b"bob")
    assert len({key, *others}) == 4


def test_processes_starting_together_agree_on_one_whole_secret(tmp_path):
    path = tmp_path / "store" / "secret"
    with ThreadPoolExecutor(8) as pool:
        got = set(pool.map(lambda _: read_or_create(path), range(32)))
    assert len(got) == 1 and len(got.pop()) == SECRET_BYTES
    assert [p.name for p in path.parent.iterdir()] == ["secret"], "no temporary file is left"


def test_a_secret_under_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="cannot create the server secret"):
        read_or_create(tmp_path / "file" / "secret")
