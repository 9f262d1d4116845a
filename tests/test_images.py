"""Image decoding and limits (real encoders via pyvips, hand-made headers for the bombs)."""

import struct
import zlib

import numpy as np
import pytest
import pyvips

from kestrel_backend.images import ImageError, ImageLimits, decode_image


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature + IHDR claiming a huge size, with one tiny IDAT: a decompression bomb's header."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def rgb(h=40, w=60, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_png_jpeg_webp_roundtrip():
    pixels = rgb()
    img = pyvips.Image.new_from_array(pixels)
    assert np.array_equal(decode_image(img.pngsave_buffer()), pixels)
    for data in (img.jpegsave_buffer(Q=95), img.webpsave_buffer(Q=95)):
        out = decode_image(data)
        assert out.shape == pixels.shape and out.dtype == np.uint8


def test_grey_alpha_and_16_bit_become_rgb():
    grey = pyvips.Image.new_from_array(rgb()[:, :, 0])
    assert decode_image(grey.pngsave_buffer()).shape == (40, 60, 3)
    rgba = pyvips.Image.new_from_array(np.dstack([rgb(), np.full((40, 60), 128, np.uint8)]))
    assert np.array_equal(decode_image(rgba.pngsave_buffer()), rgb())
    sixteen = pyvips.Image.new_from_array(rgb().astype(np.uint16) * 257).copy(interpretation="rgb16")
    assert decode_image(sixteen.pngsave_buffer()).shape == (40, 60, 3)


def test_one_pixel_image_is_served():
    assert decode_image(pyvips.Image.new_from_array(rgb(1, 1)).pngsave_buffer()).shape == (1, 1, 3)


def test_decompression_bomb_refused_from_the_header():
    with pytest.raises(ImageError, match=r"20000x20000 pixels, over the 50000000 pixel limit"):
        decode_image(png_header_only(20000, 20000))


def test_byte_limit():
    with pytest.raises(ImageError, match="over the 100 byte limit"):
        decode_image(pyvips.Image.new_from_array(rgb()).pngsave_buffer(), ImageLimits(max_bytes=100))


@pytest.mark.parametrize("data,pattern", [
    (b"", "IMAGE is empty"),
    (bytes(range(256)) * 8, "not a decodable"),
    (b"GIF89a" + b"\x00" * 20, "not a decodable|not supported"),
])
def test_garbage(data, pattern):
    with pytest.raises(ImageError, match=pattern):
        decode_image(data)


def test_truncated_jpeg_and_png():
    img = pyvips.Image.new_from_array(rgb(200, 300))
    for data in (img.jpegsave_buffer(), img.pngsave_buffer()):
        with pytest.raises(ImageError, match="IMAGE is (truncated|not a decodable)"):
            decode_image(data[: len(data) // 2])


def test_animated_and_unsupported_formats():
    frames = pyvips.Image.arrayjoin([pyvips.Image.new_from_array(rgb(seed=i)) for i in range(3)], across=1)
    frames = frames.copy()
    frames.set_type(pyvips.GValue.gint_type, "page-height", 40)
    with pytest.raises(ImageError, match="several frames"):
        decode_image(frames.webpsave_buffer())
    with pytest.raises(ImageError, match="not supported"):
        decode_image(pyvips.Image.new_from_array(rgb()).tiffsave_buffer())
