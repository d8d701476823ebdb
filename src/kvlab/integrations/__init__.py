"""Adapters that plug kvlab into existing inference engines; each is an optional extra (`kvlab[vllm]`)."""
