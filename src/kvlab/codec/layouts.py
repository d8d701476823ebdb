"""How codecs arrange KV bytes: the token view, byte planes, packed codes and video frames.

Every codec sees a tensor as `[lead, T, D]`: `T` is the token axis (the second to last one), `D` the
channels of one head (the last one) and `lead` everything before (layers x heads), so one `lead`
row is always one head. Tensors of fewer than two dimensions are one token of `numel` channels.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

# Little-endian unsigned views of each float dtype's bits, independent of the host's byte order.
_INT_VIEWS: dict[torch.dtype, tuple[torch.dtype, str]] = {
    torch.float32: (torch.int32, "<u4"),
    torch.float16: (torch.int16, "<u2"),
    torch.bfloat16: (torch.int16, "<u2"),
}
VIDEO_BLOCK = 8
# x265 refuses frames under 16 pixels a side, and (measured, PyAV 18) loses bits in inter frames 16 pixels
# wide; frames smaller than one 64-pixel coding tree unit are padded with zeros.
MIN_FRAME_SIDE = 64


def token_geometry(shape: Sequence[int]) -> tuple[int, int, int]:
    """`(lead, T, D)` of a tensor shape (see the module docstring)."""
    if len(shape) < 2:
        return 1, 1, math.prod(shape)
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def as_tokens(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as `[lead, T, D]`; a view when the tensor is contiguous."""
    return tensor.reshape(token_geometry(tensor.shape))


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's data as a numpy array (shared, not copied). Codecs cross from torch to numpy
    only here and in `integer_view`."""
    return tensor.detach().cpu().numpy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A numpy array as a tensor (shared when the array is contiguous and writeable, else copied)."""
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = np.array(array, copy=True, order="C")
    return torch.from_numpy(array)


def integer_view(chunk: torch.Tensor) -> np.ndarray:
    """The bits of a float tensor as an unsigned numpy array (native byte order) of the same shape and strides."""
    signed, unsigned = _INT_VIEWS[chunk.dtype]
    return chunk.view(signed).numpy().view(unsigned.replace("<", "="))


def from_integer_view(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `integer_view`: a float tensor of `dtype` whose bits are `bits`."""
    unsigned = _INT_VIEWS[dtype][1]
    native = np.ascontiguousarray(bits, dtype=unsigned).astype(unsigned.replace("<", "="), copy=False)
    return torch.from_numpy(native.view(native.dtype.str.replace("u", "i"))).view(dtype)


def split_byte_planes(bits: np.ndarray) -> np.ndarray:
    """`[P, *shape]` uint8 planes of unsigned integers, plane 0 the most significant byte."""
    num_planes = bits.dtype.itemsize
    planes = np.empty((num_planes, *bits.shape), dtype=np.uint8)
    for plane in range(num_planes):
        # Shifts and casts stream through memory; a strided byte view would be copied element by element.
        np.right_shift(bits, 8 * (num_planes - 1 - plane), out=planes[plane], casting="unsafe")
    return planes


def join_byte_planes(planes: np.ndarray | Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of `split_byte_planes`: unsigned integers (native byte order) from `[P, *shape]` planes.

    Args:
        planes: P uint8 arrays of one shape, most significant first.
        out: Where to write (any strides), e.g. `integer_view` of a slice of the output tensor.
    """
    num_planes = len(planes)
    bits = np.empty(planes[0].shape, dtype=f"=u{num_planes}") if out is None else out
    bits[...] = planes[0]
    for plane in planes[1:]:
        bits <<= bits.dtype.type(8)
        bits |= plane
    return bits


@dataclasses.dataclass(frozen=True)
class VideoGeometry:
    """The codec-friendly frame layout of KVCodec for `lead` heads of `channels` channels.

    One frame holds one token. Each head's channels fill their own tile of `tile_rows x tile_cols`
    pixels (whole 8x8 blocks, so no coding block mixes heads), tiles sit on a `grid_rows x
    grid_cols` grid, and the grids of the byte planes are stacked vertically.
    """

    lead: int
    channels: int
    planes: int

    @property
    def tile_cols(self) -> int:
        return VIDEO_BLOCK

    @property
    def tile_rows(self) -> int:
        return VIDEO_BLOCK * max(1, -(-self.channels // (VIDEO_BLOCK * VIDEO_BLOCK)))

    @property
    def grid_cols(self) -> int:
        return max(1, math.ceil(math.sqrt(self.lead)))

    @property
    def grid_rows(self) -> int:
        return max(1, -(-self.lead // self.grid_cols))

    @property
    def content_height(self) -> int:
        return self.planes * self.grid_rows * self.tile_rows

    @property
    def content_width(self) -> int:
        return self.grid_cols * self.tile_cols

    @property
    def height(self) -> int:
        return max(MIN_FRAME_SIDE, self.content_height)

    @property
    def width(self) -> int:
        return max(MIN_FRAME_SIDE, self.content_width)


def to_video_frames(planes: np.ndarray, geometry: VideoGeometry) -> np.ndarray:
    """Frames `[T, height, width]` uint8 from byte planes `[P, lead, T, D]`."""
    num_planes, lead, num_tokens, channels = planes.shape
    tile = geometry.tile_rows * geometry.tile_cols
    tiles = np.zeros((num_planes, geometry.grid_rows * geometry.grid_cols, num_tokens, tile), dtype=np.uint8)
    tiles[:, :lead, :, :channels] = planes
    tiles = tiles.reshape(
        num_planes, geometry.grid_rows, geometry.grid_cols, num_tokens, geometry.tile_rows, geometry.tile_cols
    )
    # -> [T, P, grid_rows, tile_rows, grid_cols, tile_cols]
    content = tiles.transpose(3, 0, 1, 4, 2, 5).reshape(num_tokens, geometry.content_height, geometry.content_width)
    frames = np.zeros((num_tokens, geometry.height, geometry.width), dtype=np.uint8)
    frames[:, : geometry.content_height, : geometry.content_width] = content
    return frames


def from_video_frames(frames: np.ndarray, geometry: VideoGeometry) -> np.ndarray:
    """Inverse of `to_video_frames`: byte planes `[P, lead, T, D]`."""
    num_tokens = frames.shape[0]
    tiles = frames[:, : geometry.content_height, : geometry.content_width].reshape(
        num_tokens, geometry.planes, geometry.grid_rows, geometry.tile_rows, geometry.grid_cols, geometry.tile_cols
    ).transpose(1, 2, 4, 0, 3, 5)
    tiles = tiles.reshape(geometry.planes, geometry.grid_rows * geometry.grid_cols, num_tokens, -1)
    return np.ascontiguousarray(tiles[:, : geometry.lead, :, : geometry.channels])
