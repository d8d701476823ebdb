"""KV-cache compressors behind one contract (see `kvlab.compress.base`), one method per module."""

from kvlab.compress import cam, h2o, kivi, snapkv, snapkv_agnostic, streamingllm, turboquant
from kvlab.compress.base import CompressedKV, CompressionContext, Compressor, compressors, create_compressor
from kvlab.compress.eviction import EvictedKV, EvictionCompressor
from kvlab.compress.merging import MergingCompressor
from kvlab.compress.quantization import QuantizationCompressor, QuantizedKV

__all__ = [
    "CompressedKV",
    "CompressionContext",
    "Compressor",
    "EvictedKV",
    "EvictionCompressor",
    "MergingCompressor",
    "QuantizationCompressor",
    "QuantizedKV",
    "cam",
    "compressors",
    "create_compressor",
    "h2o",
    "kivi",
    "snapkv",
    "snapkv_agnostic",
    "streamingllm",
    "turboquant",
]
