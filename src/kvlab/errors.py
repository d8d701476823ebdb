"""Exceptions with messages a user can act on.

`ConfigError` marks a mistake in what the user asked for (bad flag, unknown model, prompt too long);
the CLI turns it into one line on stderr and exit code 2. Anything else is a runtime failure (exit 1).
"""

from __future__ import annotations


class KvlabError(Exception):
    """Base of every error kvlab raises on purpose."""


class ConfigError(KvlabError, ValueError):
    """The request is invalid: the message says what is allowed."""


class ModelNotFoundError(ConfigError):
    """A model was named that is not available on this machine (kvlab never downloads)."""
