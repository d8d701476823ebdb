"""Prefix reuse: a prompt's leading chunks found, fetched and restored from a store, new chunks saved.

`PrefixConfig` says how (`config`); `PrefixCache` does it (`cache`) with a pipelined fetcher
(`fetcher`) whose resolutions a planner chooses per chunk (`planner`), and a background writer
(`writer`); `FetchedPrefix` is what a fetch returns (`fetched`).
"""

from kvlab.store.prefix.cache import PrefixCache, PrefixSource
from kvlab.store.prefix.config import PrefixConfig
from kvlab.store.prefix.fetched import FetchedPrefix, FetchStats

__all__ = ["FetchStats", "FetchedPrefix", "PrefixCache", "PrefixConfig", "PrefixSource"]
