"""The file:// store under a hostile co-writer: links are never followed, orphan temporary files are swept."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvlab.store import StoreUnavailableError
from kvlab.store.backends.file import ORPHAN_AGE_S, TEMP_PREFIX, FileStore


def test_a_symlinked_value_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "outside").write_bytes(b"not the store's")
    store = FileStore(tmp_path / "store")
    (tmp_path / "store" / "ke").mkdir()
    (tmp_path / "store" / "ke" / "key-1").symlink_to(tmp_path / "outside")
    with pytest.raises(StoreUnavailableError, match="link"):
        store.get("key-1")


def test_a_write_replaces_a_symlinked_value_instead_of_following_it(tmp_path: Path) -> None:
    target = tmp_path / "outside"
    target.write_bytes(b"untouched")
    store = FileStore(tmp_path / "store")
    (tmp_path / "store" / "ke").mkdir()
    (tmp_path / "store" / "ke" / "key-1").symlink_to(target)
    store.put("key-1", b"value")
    assert target.read_bytes() == b"untouched" and store.get("key-1") == b"value"


def test_a_symlinked_bucket_is_neither_written_nor_listed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    store = FileStore(tmp_path / "store")
    (tmp_path / "store" / "ke").symlink_to(outside, target_is_directory=True)
    (outside / "key-9").write_bytes(b"planted")
    with pytest.raises(StoreUnavailableError, match="link"):
        store.put("key-1", b"value")
    assert sorted(os.listdir(outside)) == ["key-9"]
    assert store.keys() == []


def test_a_symlink_swap_race_never_writes_outside_the_root(tmp_path: Path) -> None:
    """A co-writer swaps the bucket for a link to another directory, again and again, while we write."""
    outside = tmp_path / "outside"
    outside.mkdir()
    store = FileStore(tmp_path / "store")
    bucket, parked = tmp_path / "store" / "ke", tmp_path / "store" / "parked"
    bucket.mkdir()
    stop = threading.Event()

    def swapper() -> None:
        while not stop.is_set():
            try:
                os.rename(bucket, parked)
                os.symlink(outside, bucket)
                time.sleep(0)
                os.unlink(bucket)
                os.rename(parked, bucket)
            except OSError:
                pass

    thread = threading.Thread(target=swapper)
    thread.start()
    outcomes = {"written": 0, "refused": 0}
    try:
        deadline = time.monotonic() + 2.0
        i = 0
        while time.monotonic() < deadline:
            try:
                store.put(f"key-{i}", b"v" * 100)
                outcomes["written"] += 1
            except StoreUnavailableError:
                outcomes["refused"] += 1
            i += 1
    finally:
        stop.set()
        thread.join()
    assert os.listdir(outside) == [], f"a write landed outside the root ({outcomes})"
    assert outcomes["written"] + outcomes["refused"] > 10


def test_keys_skips_links_and_lists_the_rest(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    store.put("ab-1", b"x")
    (tmp_path / "store" / "ab" / "ab-2").symlink_to("/etc/hostname")
    (tmp_path / "store" / "ab" / "ab-3").symlink_to(tmp_path / "missing")
    assert store.keys() == ["ab-1"]


def test_orphan_temporary_files_older_than_a_minute_are_swept(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    store.put("ab-1", b"x")
    bucket = tmp_path / "store" / "ab"
    old, young = bucket / f"{TEMP_PREFIX}old", bucket / f"{TEMP_PREFIX}young"
    old.write_bytes(b"half a value of a killed writer")
    young.write_bytes(b"a write in progress")
    past = time.time() - ORPHAN_AGE_S - 5
    os.utime(old, (past, past))
    assert store.sweep() == 1
    assert not old.exists() and young.exists()


def test_listing_sweeps_orphans_too(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    store.put("ab-1", b"x")
    orphan = tmp_path / "store" / "ab" / f"{TEMP_PREFIX}old"
    orphan.write_bytes(b"left behind")
    past = time.time() - ORPHAN_AGE_S - 5
    os.utime(orphan, (past, past))
    fresh = FileStore(tmp_path / "store")  # a new process: its first listing of a bucket sweeps it
    assert fresh.keys() == ["ab-1"] and not orphan.exists()


def test_values_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    store.put("ab-1", b"prompt kv")
    assert (tmp_path / "store" / "ab" / "ab-1").stat().st_mode & 0o077 == 0
