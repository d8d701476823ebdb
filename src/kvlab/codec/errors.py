"""The error every codec raises for bytes it cannot trust."""

from __future__ import annotations

from kvlab.errors import KvlabError


class CodecError(KvlabError):
    """Bytes that are not a valid, intact frame for the codec asked to decode them.

    Raised for a wrong magic, version, codec, dtype, shape or parameters, for truncated, extended or
    corrupted frames, and for payloads a backend cannot decode. No decoder returns a tensor instead.
    """
