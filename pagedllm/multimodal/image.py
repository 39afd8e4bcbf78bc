"""Decoding and checking one image input: a PIL image, a numpy array, encoded bytes or a
`data:` URL, each refused with a ValueError that names the problem.

Decompression bombs: an encoded image's header is read first (PIL opens lazily) and an image
whose width x height exceeds the pixel cap is refused before any pixel is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*),(?P<data>.*)",
                       re.DOTALL)


def check_pixels(width: int, height: int, max_pixels: int, what: str = "image") -> None:
    """Raises ValueError when a `width` x `height` image is over `max_pixels`."""
    if width * height > max_pixels:
        raise ValueError(f"{what}: {width}x{height} pixels is more than the limit of "
                         f"{max_pixels} pixels")
    if width < 1 or height < 1:
        raise ValueError(f"{what}: an image of {width}x{height} pixels is empty")


def decode_image_bytes(data: bytes, max_pixels: int, what: str = "image") -> Image.Image:
    """An RGB image from encoded bytes (PNG, JPEG, ... whatever PIL reads).

    Raises:
        ValueError: the bytes are not an image PIL can decode, or the image has more than
            `max_pixels` pixels (checked from its header, before decoding).
    """
    try:
        with warnings.catch_warnings():
            # Our own cap applies; PIL's DecompressionBombWarning would only be noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            check_pixels(image.width, image.height, max_pixels, what)
            image.load()
    except ValueError:
        raise
    except Image.DecompressionBombError:
        # PIL's own cap (far above ours) fired while it read the header.
        raise ValueError(f"{what}: the image declares more pixels than the limit of "
                         f"{max_pixels} pixels (--max-image-pixels); not decoded") from None
    except UnidentifiedImageError:
        raise ValueError(f"{what}: cannot decode the image (not an image format PIL "
                         f"reads)") from None
    except Exception as e:  # noqa: BLE001 - any decoder failure is the input's fault
        raise ValueError(f"{what}: cannot decode the image ({type(e).__name__}: {e})") from None
    return image.convert("RGB")


def decode_data_url(url: str, max_pixels: int, what: str = "image_url") -> Image.Image:
    """An RGB image from a `data:image/...;base64,...` URL.

    Raises:
        ValueError: not a data URL, not base64, not an image type, or `decode_image_bytes`'s.
    """
    match = _DATA_URL.fullmatch(url.strip())
    if match is None:
        raise ValueError(f"{what}: not a data: URL")
    mime = match["mime"] or ""
    if not mime.startswith("image/"):
        raise ValueError(f"{what}: a data: URL of type {mime or 'unknown'!r} is not an image")
    if ";base64" not in match["params"]:
        raise ValueError(f"{what}: only base64 data: URLs are supported")
    try:
        raw = base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: the data: URL's payload is not valid base64") from None
    return decode_image_bytes(raw, max_pixels, what)


def load_image(image, max_pixels: int, what: str = "image") -> Image.Image:
    """An RGB PIL image from a PIL image, a numpy array ([H, W] or [H, W, 3|4], uint8 or float
    in [0, 1]), encoded bytes or a `data:` URL string.

    Raises:
        ValueError: naming `what` and the problem (type, shape, float values outside [0, 1],
            decoding, pixel cap).
    """
    if isinstance(image, Image.Image):
        check_pixels(image.width, image.height, max_pixels, what)
        return image.convert("RGB") if image.mode != "RGB" else image
    if isinstance(image, np.ndarray):
        if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise ValueError(f"{what}: a numpy image must be [H, W] or [H, W, 1|3|4], got "
                             f"shape {list(image.shape)}")
        check_pixels(image.shape[1], image.shape[0], max_pixels, what)
        if image.dtype != np.uint8:
            if not np.issubdtype(image.dtype, np.floating):
                raise ValueError(f"{what}: a numpy image must be uint8 or float, got "
                                 f"{image.dtype}")
            if image.size and not (np.isfinite(image).all() and image.min() >= 0.0
                                   and image.max() <= 1.0):
                raise ValueError(f"{what}: a float numpy image must hold values in [0, 1] "
                                 f"(got {image.min():g} .. {image.max():g}); scale a "
                                 "0-255 image by 1/255 or pass uint8")
            image = (image * 255).round().astype(np.uint8)
        if image.ndim == 3 and image.shape[2] == 1:
            image = image[:, :, 0]
        return Image.fromarray(image).convert("RGB")
    if isinstance(image, (bytes, bytearray)):
        return decode_image_bytes(bytes(image), max_pixels, what)
    if isinstance(image, str):
        if image.startswith("data:"):
            return decode_data_url(image, max_pixels, what)
        raise ValueError(f"{what}: this URL is not fetched: give a data: URL, or on the server "
                         "an http(s): or file: URL that --allowed-media-domains / "
                         "--allowed-local-media-path allow")
    raise ValueError(f"{what}: expected a PIL image, a numpy array, bytes or a data: URL, got "
                     f"{type(image).__name__}")
