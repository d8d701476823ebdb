"""`file:///path`: one file per key under a root directory, written atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from kvlab.errors import ConfigError
from kvlab.store.base import KVStore, check_bytes, check_key, stores


@stores.register("file")
class FileStore(KVStore):
    """One file per key under a root directory, written atomically.

    A key is stored as `root/<first two characters>/<key>`; a write goes to a temporary file that is
    renamed into place, so a reader never sees half a value.
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
        path.parent.mkdir(exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=".put-", dir=path.parent)
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(payload)
            os.replace(staging, path)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
