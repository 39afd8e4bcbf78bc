"""Image inputs before the engine: decoding PIL images, numpy arrays, bytes and data URLs, and
the refusals (bad shapes and types, undecodable bytes, a decompression bomb refused from its
header, too many images, placeholder counts)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest

from pagedllm.multimodal.image import load_image
from tests.fixtures.vlm import draw_image


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def bomb_png(width: int, height: int) -> bytes:
    """A small PNG whose header claims `width` x `height` pixels (CRC fixed up)."""
    data = bytearray(png_bytes(draw_image(8, 8, 0)))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr:ihdr + 17])) & 0xFFFFFFFF
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


def test_numpy_and_encoded_images_decode_alike():
    image = draw_image(24, 16, 5)
    array = np.asarray(image)
    for source in (image, array, array.astype(np.float32) / 255.0, png_bytes(image),
                   "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()):
        out = load_image(source, 10_000)
        assert out.mode == "RGB" and out.size == (24, 16)
        assert np.array_equal(np.asarray(out), array)
    assert load_image(array[:, :, 0], 10_000).size == (24, 16)      # greyscale


@pytest.mark.parametrize("source, problem", [
    (np.zeros((4, 4, 2), dtype=np.uint8), "must be"),
    (np.zeros((4, 4, 3), dtype=np.int32), "uint8 or float"),
    (np.full((4, 4, 3), 2.0, dtype=np.float32), r"values in \[0, 1\] \(got 2 \.\. 2\)"),
    (np.full((4, 4, 3), np.nan, dtype=np.float32), r"values in \[0, 1\]"),
    (b"not an image", r"cannot decode the image \(not an image format"),
    ("file:///etc/passwd", "data: URL"),
    (42, "expected a PIL image"),
    (bomb_png(5000, 5000), "more than the limit"),
    (bomb_png(100_000, 100_000), r"limit of 10000 pixels \(--max-image-pixels\)"),
    (np.zeros((200, 200, 3), dtype=np.uint8), "more than the limit"),
])
def test_bad_images_name_the_problem(source, problem):
    with pytest.raises(ValueError, match=problem):
        load_image(source, 10_000, "image 0")


def test_prompt_checks(tiny_idefics3):
    from pagedllm.config import MultiModalConfig
    from pagedllm.multimodal.processing import MultiModalProcessor
    from pagedllm.hf_config import read_hf_config

    mm = MultiModalProcessor.from_pretrained(str(tiny_idefics3), read_hf_config(
        str(tiny_idefics3)), MultiModalConfig(limit_per_prompt={"image": 2}))
    image = draw_image(32, 32, 1)
    with pytest.raises(ValueError, match="1 image placeholder"):
        mm.process("one <image> only", [image, image])
    with pytest.raises(ValueError, match="limit of 2"):
        mm.process("<image><image><image>", [image] * 3)
    ids, [feature] = mm.process("a <image> b", image)
    assert feature.num_embeds == 4 * 5 and int(np.sum(np.asarray(ids) ==
                                                      mm.image_token_id)) == 20


def test_images_cross_to_the_engine_core_process_as_plain_arrays():
    """multiprocess_mode: an image's placeholder range and encoder inputs survive the wire
    format; a frame naming any other array dtype is refused, never interpreted."""
    import msgspec

    from pagedllm import SamplingParams
    from pagedllm.engine.core_serial import (make_encoder, make_input_decoder,
                                             request_from_wire, request_to_wire)
    from pagedllm.engine.engine_core import EngineCoreRequest
    from pagedllm.multimodal.inputs import MultiModalFeature

    pixels = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    feature = MultiModalFeature("image", "ab" * 32, 3, 5, np.array([0, 1, 1, 1, 0], bool),
                                {"pixel_values": pixels}, bidirectional=True)
    req = EngineCoreRequest("r", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=2), 2,
                            mm_features=[feature])
    frame = make_encoder().encode(request_to_wire(req))
    [back] = request_from_wire(make_input_decoder().decode(frame)).mm_features
    assert (back.identifier, back.offset, back.length, back.bidirectional) == \
        ("ab" * 32, 3, 5, True)
    assert back.is_embed.tolist() == feature.is_embed.tolist()
    np.testing.assert_array_equal(back.data["pixel_values"], pixels)
    bad = msgspec.msgpack.decode(frame)
    bad[8][0][5]["pixel_values"][0] = "object"
    with pytest.raises(ValueError, match="dtype 'object' is not accepted"):
        request_from_wire(make_input_decoder().decode(msgspec.msgpack.encode(bad)))
