"""`file:///path`: one file per key under a root directory, written atomically, never through a link.

Others may write to a shared store directory, so every path below the root is resolved one component
at a time against an open directory descriptor with `O_NOFOLLOW`: a bucket or key replaced by a
symlink (even between a check and a write) makes the operation fail instead of reaching outside the
root. Values are written to a temporary file that is renamed into place, so a reader never sees half
a value; temporary files a killed writer left behind are removed once they are a minute old.

A value's size is read with `fstat` before any byte of it, so a bounded read (`get(key, max_bytes)`)
refuses a huge (even sparse) file without reading it, and `contains`/`nbytes` never read values. A
value with more than one hard link is refused: the store never makes one, and a link planted by
another user would let them change the bytes later without replacing the file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kvlab.errors import ConfigError
from kvlab.store.backends.base import (
    KVStore,
    StoredValueError,
    StoreUnavailableError,
    check_bytes,
    check_key,
    check_prefix,
    check_size,
    is_key,
    stores,
)

TEMP_PREFIX = ".put-"
# A write takes well under a second; a temporary file a minute old belongs to a writer that died.
ORPHAN_AGE_S = 60.0
# What opening a bucket meets when someone removed it or put a link or a file in its place.
_REPLACED = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@stores.register("file")
class FileStore(KVStore):
    """One file per key under a root directory (see the module docstring).

    A key is stored as `root/<first two characters>/<key>`. I/O failures other than a missing key
    (permissions, full disk, a vanished mount, a link where a bucket or value should be) raise
    StoreUnavailableError; a value that is too large or hard-linked raises StoredValueError. The root
    directory (when the store creates it), buckets and values are created for their owner only:
    stored KV reveals the prompts it came from.
    """

    def __init__(self, root: Path, create: bool = True) -> None:
        self.root = root.resolve()
        self.url = f"file://{self.root}"
        if not create and not self.root.is_dir():
            raise ConfigError(f"no store at {self.url}: the directory does not exist (check the path)")
        try:
            # mkdir's mode is masked by the umask, never widened by it: 0700 even under umask 000.
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot create store directory {self.root}: {error.strerror}") from None
        self._swept: dict[str, float] = {}

    @classmethod
    def from_url(cls, url: str, create: bool = True) -> FileStore:
        parsed = urlsplit(url)
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise ConfigError(f"file store URLs look like file:///absolute/path, got {url!r}")
        return cls(Path(unquote(parsed.path)), create)

    def put(self, key: str, data: bytes) -> None:
        payload = check_bytes(data)
        check_key(key)
        try:
            with self._bucket(key[:2], create=True) as bucket:
                self._sweep(bucket, key[:2])
                staging = f"{TEMP_PREFIX}{secrets.token_hex(8)}"
                handle = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o600, dir_fd=bucket)
                try:
                    with os.fdopen(handle, "wb") as file:
                        file.write(payload)
                    # rename() replaces a link planted under the key's name instead of following it.
                    os.replace(staging, key, src_dir_fd=bucket, dst_dir_fd=bucket)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(staging, dir_fd=bucket)
                    raise
        except OSError as error:
            raise self._unavailable("write", key, error) from error

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        check_key(key)
        try:
            with self._bucket(key[:2]) as bucket, self._value(bucket, key, for_reading=True) as handle:
                size = os.fstat(handle).st_size
                check_size(key, size, max_bytes, self.url)
                with os.fdopen(os.dup(handle), "rb") as file:
                    # A file that grew after the fstat is read one byte past its size (or the bound), so the
                    # growth shows; reading up to the bound itself would allocate the bound.
                    data = file.read() if max_bytes is None else file.read(min(size, max_bytes) + 1)
                if len(data) > size:
                    raise StoredValueError(f"{self.url}: the value under {key!r} grew while it was read (the store "
                                           "never writes in place: someone else does); not using it")
                return data
        except FileNotFoundError:
            return None
        except OSError as error:
            raise self._unavailable("read", key, error) from error

    def delete(self, key: str) -> None:
        check_key(key)
        try:
            with self._bucket(key[:2]) as bucket:
                os.unlink(key, dir_fd=bucket)
        except FileNotFoundError:
            return
        except OSError as error:
            raise self._unavailable("delete", key, error) from error

    def keys(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        found = []
        try:
            with os.scandir(self.root) as buckets:
                # A bucket is named by its keys' first two characters, so most can be skipped.
                names = [entry.name for entry in buckets
                         if entry.is_dir(follow_symlinks=False) and entry.name.startswith(prefix[:2])]
            for name in names:
                found.extend(self._bucket_keys(name, prefix))
        except FileNotFoundError:
            return []
        except OSError as error:
            raise self._unavailable("list", prefix + "*", error) from error
        return sorted(found)

    def contains(self, key: str) -> bool:
        return self.nbytes(key) is not None

    def nbytes(self, key: str) -> int | None:
        check_key(key)
        try:
            with self._bucket(key[:2]) as bucket, self._value(bucket, key) as handle:
                return os.fstat(handle).st_size
        except FileNotFoundError:
            return None
        except OSError as error:
            raise self._unavailable("stat", key, error) from error

    def sweep(self, max_age_s: float = ORPHAN_AGE_S) -> int:
        """Remove temporary files older than `max_age_s` from every bucket; returns how many."""
        removed = 0
        with os.scandir(self.root) as buckets:
            names = [entry.name for entry in buckets if entry.is_dir(follow_symlinks=False)]
        for name in names:
            try:
                with self._bucket(name) as bucket:
                    removed += self._sweep(bucket, name, max_age_s, force=True)
            except OSError as error:
                if error.errno not in _REPLACED:
                    raise
        return removed

    @contextlib.contextmanager
    def _bucket(self, name: str, create: bool = False) -> Iterator[int]:
        """A descriptor of bucket `name`, opened without following links (FileNotFoundError when absent)."""
        root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=root)
            try:
                bucket = os.open(name, _DIR_FLAGS, dir_fd=root)
            except OSError as error:
                raise _link_error(error, name) from None
        finally:
            os.close(root)
        try:
            yield bucket
        finally:
            os.close(bucket)

    @contextlib.contextmanager
    def _value(self, bucket: int, key: str, for_reading: bool = False) -> Iterator[int]:
        """A descriptor of the regular file holding `key`'s value, opened without following links; one
        `for_reading` its bytes must have no other hard link."""
        try:
            handle = os.open(key, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=bucket)
        except OSError as error:
            raise _link_error(error, key) from None
        try:
            status = os.fstat(handle)
            if not stat.S_ISREG(status.st_mode):
                raise OSError(errno.EINVAL, f"{key} is not a regular file")
            if for_reading and status.st_nlink > 1:
                raise StoredValueError(
                    f"{self.url}: the value under {key!r} has {status.st_nlink} hard links (the store makes none; "
                    "someone linked it, and could change it through the other name); not reading it"
                )
            yield handle
        finally:
            os.close(handle)

    def _bucket_keys(self, name: str, prefix: str) -> list[str]:
        try:
            with self._bucket(name) as bucket:
                self._sweep(bucket, name)
                with os.scandir(bucket) as scan:
                    entries = list(scan)
        except OSError as error:
            if error.errno in _REPLACED:  # removed, or replaced by a link, while listing
                return []
            raise
        # Temporary files start with "." and so are never keys; anything else that is not a key of this
        # bucket, or not a regular file, was put there by hand and is not the store's.
        return [entry.name for entry in entries
                if is_key(entry.name) and entry.name[:2] == name and entry.name.startswith(prefix)
                and entry.is_file(follow_symlinks=False)]

    def _sweep(self, bucket: int, name: str, max_age_s: float = ORPHAN_AGE_S, force: bool = False) -> int:
        """Remove old temporary files from one bucket, at most once a minute per bucket unless `force`."""
        now = time.time()
        if not force and now - self._swept.get(name, 0.0) < ORPHAN_AGE_S:
            return 0
        self._swept[name] = now
        removed = 0
        with os.scandir(bucket) as scan:
            for entry in scan:
                if not entry.name.startswith(TEMP_PREFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > max_age_s:
                        os.unlink(entry.name, dir_fd=bucket)
                        removed += 1
        return removed

    def _unavailable(self, action: str, key: str, error: OSError) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"file store {self.root}: cannot {action} {key!r}: {error.strerror or error}; "
            "check that the directory exists, is writable by this user and its disk is not full"
        )


def _link_error(error: OSError, name: str) -> OSError:
    """An open that met a symlink (ELOOP, or ENOTDIR for a linked directory) says so."""
    if error.errno in (errno.ELOOP, errno.ENOTDIR):
        return OSError(error.errno, f"{name} is a link or not what the store put there; refusing to follow it")
    return error
