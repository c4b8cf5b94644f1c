"""Encoded images as model inputs: decode, resize and normalize as the model's ``model.yaml``
declares (:class:`ppipe.spec.profile.ImagePreprocess`), off the event loop.

A client of a model with a ``preprocess`` may send its input as a ``BYTES`` tensor of N
elements (shape ``[N]`` or ``[N, 1]``), each the bytes of an image file (JPEG, PNG, WebP,
BMP, TIFF), instead of an ``[N, *input shape]`` tensor. :func:`prepare_images` turns them
into that tensor: OpenCV decodes (``cv2.imdecode``: libjpeg-turbo, EXIF orientation
applied) and resizes; numpy normalizes each channel as ``p x (scale / std) - mean / std``
straight into the output (one pass, no temporary float image).

OpenCV, not Pillow: on a 1080p frame resized to 800 x 1333 (atss's input) OpenCV's
bilinear resize costs a tenth of Pillow's, whose bilinear filter widens with the scale
(an antialiasing filter), and it is the resize the detectors were trained with (mmcv
resizes with OpenCV); ``scripts/bench_images.py`` prints both. It is the extra
``ppipe[images]``; without it a server answers BYTES inputs with 415 and a fix.

:class:`ImagePool` runs the decodes on threads (``cv2.imdecode``, ``cv2.resize`` and
numpy's arithmetic release the GIL; OpenCV's own threading is set to one thread per call,
so that N decodes in flight use N cores and no more) with the admission of the JSON decode
pool: a decode that is expected to end too late for its request's deadline is dropped
before it is queued.

Hostile input: at most :data:`MAX_IMAGE_PIXELS` pixels per image, read from the file's
header (Pillow's lazy open, tens of microseconds) before anything is decoded: a 100 kB PNG
cannot claim gigabytes. Whatever fails to decode is a 400 naming the element.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import os
from typing import Sequence

import numpy as np

from ppipe.dataplane.decode import expected_end
from ppipe.runtime.ingress.protocol import ProtocolError
from ppipe.runtime.scheduler.host import DroppedError
from ppipe.spec.profile import ImagePreprocess, TensorSpec

MAX_IMAGE_PIXELS = 50_000_000
"""The most pixels an image may have (an 8K frame has 33 M)."""
MAX_QUEUED_IMAGES = 256  # requests of images waiting for a thread; more are 503 queue-full
DECODE_S_PER_BYTE_PRIOR = 15e-9  # decode + resize of JPEG bytes, before the first measurement
IMAGES_EXTRA = "pip install 'ppipe[images]'"

_INTERPOLATION = {"linear": "INTER_LINEAR", "area": "INTER_AREA", "nearest": "INTER_NEAREST"}
_cv2_module = None


def image_support_missing() -> str | None:
    """Why this installation cannot decode images (OpenCV is missing), or None when it can."""
    try:
        _cv2()
        import PIL  # noqa: F401 (the header check)
    except ImportError as exc:
        return f"decoding images needs OpenCV and Pillow ({exc}); {IMAGES_EXTRA}"
    return None


def _cv2():
    """OpenCV, imported on first use, one thread per call."""
    global _cv2_module
    if _cv2_module is None:
        import cv2

        cv2.setNumThreads(1)
        _cv2_module = cv2
    return _cv2_module


def prepare_images(blobs: Sequence[bytes], pre: ImagePreprocess, spec: TensorSpec, where: str = "inputs[0]") -> np.ndarray:
    """The model input ``[N, *spec.shape]`` of ``spec.dtype`` made of N encoded images.

    Raises:
        ProtocolError: 400 naming the element that is not a decodable image (or is larger
            than :data:`MAX_IMAGE_PIXELS`).
    """
    h, w, c = pre.geometry(spec)
    out = np.empty((len(blobs), *spec.shape), dtype=np.dtype(spec.dtype))
    for i, blob in enumerate(blobs):
        pixels = _decode(blob, pre, f"{where}.data[{i}]", h, w)
        resized = _resize(pixels, pre, h, w)
        _normalize_into(resized, pre, out[i])
    return out


def _decode(blob: bytes, pre: ImagePreprocess, where: str, h: int, w: int) -> np.ndarray:
    """The image ``blob`` as ``ih x iw x 3`` (BGR) or ``ih x iw`` (gray) uint8 pixels, for
    a resize to ``h x w``.

    A JPEG much larger than ``h x w`` is decoded at 1/2, 1/4 or 1/8 of its size (libjpeg's
    scaling in the DCT domain: each output pixel the mean of a 2 x 2 .. 8 x 8 block, several
    times cheaper than a full decode) where its shorter side stays at least ``max(h, w)``:
    true whichever way its EXIF orientation turns it, and what it leaves is resized as usual.
    """
    cv2 = _cv2()
    if not isinstance(blob, (bytes, bytearray, memoryview)) or len(blob) == 0:
        raise ProtocolError(400, f"{where} is empty; send the bytes of an image file (JPEG, PNG, WebP, BMP, TIFF)")
    fmt, (iw, ih) = _header(blob, where)
    reduce = next((f for f in (8, 4, 2) if fmt == "JPEG" and min(iw, ih) // f >= max(h, w)), 1)
    gray = pre.color == "GRAY"
    flag = {1: cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR,
            2: cv2.IMREAD_REDUCED_GRAYSCALE_2 if gray else cv2.IMREAD_REDUCED_COLOR_2,
            4: cv2.IMREAD_REDUCED_GRAYSCALE_4 if gray else cv2.IMREAD_REDUCED_COLOR_4,
            8: cv2.IMREAD_REDUCED_GRAYSCALE_8 if gray else cv2.IMREAD_REDUCED_COLOR_8}[reduce]
    try:
        pixels = cv2.imdecode(np.frombuffer(blob, dtype=np.uint8), flag)
    except cv2.error:  # a codec's own refusal
        pixels = None
    if pixels is None or pixels.size == 0:
        raise ProtocolError(400, f"{where} ({len(blob)} bytes) is not an image OpenCV can decode (JPEG, PNG, WebP, BMP, TIFF); "
                                 "send the image file's bytes as they are")
    return pixels


def _header(blob: bytes, where: str) -> tuple[str, tuple[int, int]]:
    """The image's format and (width, height) from its header; refuses one that claims more
    than :data:`MAX_IMAGE_PIXELS` pixels (or has no header Pillow knows)."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(blob)) as im:  # reads the header only
                fmt, (w, h) = im.format, im.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        raise ProtocolError(400, f"{where} ({len(blob)} bytes) is not an image file (JPEG, PNG, WebP, BMP, TIFF); "
                                 "send the file's bytes as they are") from None
    if w * h > MAX_IMAGE_PIXELS:
        raise ProtocolError(400, f"{where} is {w} x {h} = {w * h:,} pixels; images of at most {MAX_IMAGE_PIXELS:,} pixels are taken")
    return fmt, (w, h)


def _resize(pixels: np.ndarray, pre: ImagePreprocess, h: int, w: int) -> np.ndarray:
    """``pixels`` at ``h x w``: stretched, or letterboxed (aspect kept, padded at the bottom and right)."""
    cv2 = _cv2()
    ih, iw = pixels.shape[:2]
    flag = getattr(cv2, _INTERPOLATION[pre.interpolation])
    if pre.resize == "stretch":
        return pixels if (ih, iw) == (h, w) else cv2.resize(pixels, (w, h), interpolation=flag)
    s = min(h / ih, w / iw)
    nh, nw = max(1, min(h, round(ih * s))), max(1, min(w, round(iw * s)))
    canvas = np.full((h, w, *pixels.shape[2:]), pre.pad_value, dtype=np.uint8)
    canvas[:nh, :nw] = pixels if (ih, iw) == (nh, nw) else cv2.resize(pixels, (nw, nh), interpolation=flag)
    return canvas


def _normalize_into(pixels: np.ndarray, pre: ImagePreprocess, out: np.ndarray) -> None:
    """Write ``(p x scale - mean) / std`` of each channel of the ``h x w (x 3)`` BGR/gray
    ``pixels`` into ``out`` (one sample of the input, in its layout and dtype); uint8
    inputs take the pixels as they are."""
    if pixels.ndim == 2:
        planes = [pixels]
    else:
        bgr = _cv2().split(pixels)  # contiguous planes: the arithmetic below runs at memory speed
        planes = [bgr[j] for j in ((2, 1, 0) if pre.color == "RGB" else (0, 1, 2))]
    mean = np.broadcast_to(np.asarray(pre.mean, np.float32), (len(planes),))
    std = np.broadcast_to(np.asarray(pre.std, np.float32), (len(planes),))
    gain, offset = np.float32(pre.scale) / std, -mean / std
    for k, plane in enumerate(planes):
        dst = out[k] if pre.layout == "NCHW" else out[..., k]
        if out.dtype == np.uint8:
            dst[...] = plane
        else:
            np.multiply(plane, gain[k], out=dst, casting="unsafe")
            dst += offset[k].astype(out.dtype)


class ImagePool:
    """Prepares the images of infer requests on a pool of threads, with admission control.

    Admission (as :class:`ppipe.runtime.ingress.bodies.BodyDecoder`'s): a request's images
    are expected to be ready ``(queued bytes / workers + own bytes) x seconds-per-byte``
    from now (:meth:`expected_end_s`), seconds-per-byte a moving average of the measured
    preparations; the frontend drops a request whose images would be ready after its
    deadline before it is queued.

    Args:
        workers: threads (each one core while it decodes).
        max_queued: requests waiting for (or in) a thread; more raise ``DroppedError("queue-full")``.
    """

    def __init__(self, workers: int, max_queued: int = MAX_QUEUED_IMAGES):
        if workers < 1:
            raise ValueError(f"image workers must be >= 1, got {workers}")
        self.workers, self.max_queued = workers, max_queued
        self.s_per_byte = DECODE_S_PER_BYTE_PRIOR
        self.queued, self.queued_bytes = 0, 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def expected_end_s(self, nbytes: int) -> float:
        """Seconds from now until images of ``nbytes`` submitted now would be ready."""
        return expected_end(0.0, self.queued_bytes * self.s_per_byte, self.workers, nbytes * self.s_per_byte)

    async def prepare(self, blobs: Sequence[bytes], pre: ImagePreprocess, spec: TensorSpec) -> np.ndarray:
        """:func:`prepare_images` on a thread of the pool.

        Raises:
            ProtocolError: an element is not a decodable image (400), or OpenCV is missing (415).
            DroppedError: queue-full.
        """
        missing = image_support_missing()
        if missing:
            raise ProtocolError(415, f"this server cannot take images: {missing}; or send the input as a tensor")
        if self.queued >= self.max_queued:
            raise DroppedError("queue-full", f"{self.queued} requests of images are waiting to be decoded; send fewer")
        nbytes = sum(len(b) for b in blobs)
        self.queued += 1
        self.queued_bytes += nbytes
        try:
            arr, took_s = await asyncio.get_running_loop().run_in_executor(self._executor(), _timed_prepare, blobs, pre, spec)
        finally:
            self.queued -= 1
            self.queued_bytes -= nbytes
        self.s_per_byte = 0.8 * self.s_per_byte + 0.2 * took_s / max(1, nbytes)
        return arr

    def stop(self) -> None:
        """Stop the threads (a decode in progress ends first: bounded by the body limit)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="ppipe-images")
        return self._pool


def _timed_prepare(blobs, pre, spec) -> tuple[np.ndarray, float]:
    import time

    t = time.perf_counter()
    arr = prepare_images(blobs, pre, spec)
    return arr, time.perf_counter() - t


def default_image_workers() -> int:
    """Threads of the image pool: half of the CPUs, at least 1 (the rest serve the event
    loop and the workers)."""
    return max(1, (os.cpu_count() or 1) // 2)
