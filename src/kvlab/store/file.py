"""`file:///path`: one file per key under a root directory, written atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from kvlab.errors import ConfigError
from kvlab.store.base import KVStore, StoreUnavailableError, check_bytes, check_key, check_prefix, is_key, stores


@stores.register("file")
class FileStore(KVStore):
    """One file per key under a root directory, written atomically.

    A key is stored as `root/<first two characters>/<key>`; a write goes to a temporary file that is
    renamed into place, so a reader never sees half a value. I/O failures other than a missing key
    (permissions, full disk, a vanished mount) raise StoreUnavailableError.
    """

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot create store directory {self.root}: {error.strerror}") from None

    @classmethod
    def from_url(cls, url: str) -> FileStore:
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise ConfigError(f"file store URLs look like file:///absolute/path, got {url!r}")
        return cls(Path(unquote(parsed.path)))

    def _path(self, key: str) -> Path:
        check_key(key)
        path = (self.root / key[:2] / key).resolve()
        # check_key already rules out separators; this guards the invariant itself.
        if self.root not in path.parents:
            raise ConfigError(f"store key {key!r} escapes the store root")
        return path

    def put(self, key: str, data: bytes) -> None:
        payload = check_bytes(data)
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, staging = tempfile.mkstemp(prefix=".put-", dir=path.parent)
        except OSError as error:
            raise self._unavailable("write", key, error) from error
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(payload)
            os.replace(staging, path)
        except BaseException as error:
            Path(staging).unlink(missing_ok=True)
            if isinstance(error, OSError):
                raise self._unavailable("write", key, error) from error
            raise

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise self._unavailable("read", key, error) from error

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            raise self._unavailable("delete", key, error) from error

    def keys(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        found = []
        try:
            with os.scandir(self.root) as buckets:
                for bucket in buckets:
                    # A bucket is named by its keys' first two characters, so most can be skipped.
                    if bucket.is_dir() and bucket.name.startswith(prefix[:2]):
                        found.extend(self._bucket_keys(bucket.path, bucket.name, prefix))
        except FileNotFoundError:
            return []
        except OSError as error:
            raise self._unavailable("list", prefix + "*", error) from error
        return sorted(found)

    def nbytes(self, key: str) -> int | None:
        path = self._path(key)
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return None
        except OSError as error:
            raise self._unavailable("stat", key, error) from error

    @staticmethod
    def _bucket_keys(bucket: str, bucket_name: str, prefix: str) -> list[str]:
        try:
            with os.scandir(bucket) as scan:
                entries = list(scan)
        except FileNotFoundError:  # removed by hand while listing
            return []
        # Temporary files start with "." and so are never keys; anything else that is not a key of this
        # bucket was put there by hand and is not the store's.
        return [entry.name for entry in entries
                if is_key(entry.name) and entry.name[:2] == bucket_name and entry.name.startswith(prefix)
                and entry.is_file()]

    def _unavailable(self, action: str, key: str, error: OSError) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"file store {self.root}: cannot {action} {key!r}: {error.strerror or error}; "
            "check that the directory exists, is writable by this user and its disk is not full"
        )
