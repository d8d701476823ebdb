"""Groupwise min-max quantization and dense code packing: pure tensor and byte functions.

A leaf module: it imports nothing from kvlab, so both the compressors (`kvlab.compress`) and the
codecs (`kvlab.codec`) build on it without one reaching into the other.
"""

from __future__ import annotations

from kvlab.quant.groupwise import BITS, QuantizedGroups, dequantize, error_bound, kv_axis, num_groups, quantize
from kvlab.quant.packing import pack_codes, packed_nbytes, unpack_codes

__all__ = [
    "BITS",
    "QuantizedGroups",
    "dequantize",
    "error_bound",
    "kv_axis",
    "num_groups",
    "pack_codes",
    "packed_nbytes",
    "quantize",
    "unpack_codes",
]
