"""kvlab inside vLLM: a KV connector over kvlab stores and codecs, and a compressed-cache self-drafter.

The two lines a vLLM user adds (see docs/vllm.md)::

    kv_transfer_config=KVTransferConfig(kv_connector="KVLabConnector",
        kv_connector_module_path="kvlab.integrations.vllm", kv_role="kv_both",
        kv_connector_extra_config={"store": "redis://host:6379/0"}),
    speculative_config={"method": "custom_class", "model": "kvlab.integrations.vllm.KVLabDraftProposer",
                        "num_speculative_tokens": 4},

Importing this package does not import vLLM; the classes load it on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVLabConnector", "KVLabDraftProposer"]


def __getattr__(name: str) -> Any:
    if name == "KVLabConnector":
        from kvlab.integrations.vllm.connector import KVLabConnector

        return KVLabConnector
    if name == "KVLabDraftProposer":
        from kvlab.integrations.vllm.proposer import KVLabDraftProposer

        return KVLabDraftProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
