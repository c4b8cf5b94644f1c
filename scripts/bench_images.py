"""What an encoded image costs the ingress: decode + resize per library, the whole
preparation per model input, and the image pool's rate with 1..N threads.

The frame is 1920 x 1080, tiled from scikit-learn's two sample photos (real camera images,
640 x 427, shipped with scikit-learn: nothing is downloaded) and saved as a JPEG of quality
85 (about what a camera sends). Figures are CPU time of this process per frame (one core,
OpenCV's own threading off), the median of ``--repeat`` runs, then the pool's frames per
second of wall time. What they leave out: the HTTP read of the body (the serving benchmarks
count it) and PNG or other formats (JPEG is the video-analytics case).

    python scripts/bench_images.py [--repeat 30]

The issue's target: decode + resize of a 1080p frame to 800 x 1333 within 10 ms of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostspeed import host_line  # noqa: E402

ATSS_HW = (800, 1333)
TARGET_MS = 10.0


def camera_frame(quality: int = 85) -> bytes:
    """A 1080p JPEG made of scikit-learn's sample photos, tiled 3 x 3 and cropped."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    tiles = [load_sample_image("china.jpg"), load_sample_image("flower.jpg")]
    rows = [np.concatenate([tiles[(r + c) % 2] for c in range(3)], axis=1) for r in range(3)]
    frame = np.concatenate(rows, axis=0)[:1080, :1920]
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def cpu_ms(fn, repeat: int) -> float:
    """Median CPU time of ``fn()`` in ms (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        times.append((time.process_time() - t) * 1e3)
    return statistics.median(times)


def library_rows(jpeg: bytes, repeat: int) -> list[tuple[str, float]]:
    import cv2
    from PIL import Image

    cv2.setNumThreads(1)
    h, w = ATSS_HW
    buf = np.frombuffer(jpeg, np.uint8)
    decoded = cv2.imdecode(buf, cv2.IMREAD_COLOR)
    pil_decoded = Image.open(io.BytesIO(jpeg))
    pil_decoded.load()
    return [
        ("OpenCV imdecode", cpu_ms(lambda: cv2.imdecode(buf, cv2.IMREAD_COLOR), repeat)),
        ("OpenCV resize, linear", cpu_ms(lambda: cv2.resize(decoded, (w, h), interpolation=cv2.INTER_LINEAR), repeat)),
        ("OpenCV decode + resize (ppipe's)", cpu_ms(lambda: cv2.resize(cv2.imdecode(buf, cv2.IMREAD_COLOR), (w, h)), repeat)),
        ("Pillow decode", cpu_ms(lambda: Image.open(io.BytesIO(jpeg)).load(), repeat)),
        ("Pillow resize, bilinear (antialiased)", cpu_ms(lambda: pil_decoded.resize((w, h), Image.BILINEAR), repeat)),
        ("Pillow decode + resize", cpu_ms(lambda: Image.open(io.BytesIO(jpeg)).convert("RGB").resize((w, h), Image.BILINEAR), repeat)),
    ]


def preparation_rows(jpeg: bytes, repeat: int) -> list[tuple[str, float]]:
    from ppipe.runtime.ingress.images import prepare_images
    from ppipe.spec.profile import IMAGENET_PREPROCESS, ImagePreprocess, TensorSpec

    mmdet = ImagePreprocess(color="RGB", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375])
    atss = TensorSpec(name="input", shape=[3, *ATSS_HW])
    resnet = TensorSpec(name="input", shape=[3, 224, 224])
    return [
        ("atss input (3 x 800 x 1333 fp32, stretch)", cpu_ms(lambda: prepare_images([jpeg], mmdet, atss), repeat)),
        ("atss input, letterbox", cpu_ms(lambda: prepare_images([jpeg], mmdet.model_copy(update={"resize": "letterbox"}), atss), repeat)),
        ("resnet50 input (3 x 224 x 224 fp32, ImageNet)", cpu_ms(lambda: prepare_images([jpeg], IMAGENET_PREPROCESS, resnet), repeat)),
    ]


def pool_rate(jpeg: bytes, threads: int, frames: int) -> float:
    """Frames per wall second through an ImagePool of ``threads``, ``frames`` in flight at once."""
    from ppipe.runtime.ingress.images import ImagePool
    from ppipe.spec.profile import ImagePreprocess, TensorSpec

    pre = ImagePreprocess(color="RGB", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375])
    spec = TensorSpec(name="input", shape=[3, *ATSS_HW])

    async def main() -> float:
        pool = ImagePool(threads)
        await pool.prepare([jpeg], pre, spec)  # threads started
        t = time.perf_counter()
        await asyncio.gather(*(pool.prepare([jpeg], pre, spec) for _ in range(frames)))
        took = time.perf_counter() - t
        pool.stop()
        return frames / took

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=30, help="runs per figure (the median is printed)")
    args = ap.parse_args()
    print(host_line())
    print(f"load average {os.getloadavg()[0]:.2f} (run with nothing else on the cores)")
    jpeg = camera_frame()
    print(f"frame: 1920 x 1080 JPEG, quality 85, {len(jpeg):,} bytes (scikit-learn's sample photos, tiled)")
    print("\nCPU ms per frame, one core (median):")
    for name, ms in library_rows(jpeg, args.repeat) + preparation_rows(jpeg, args.repeat):
        print(f"  {name:48s} {ms:7.2f}")
    print("\nimage pool, atss input, wall rate:")
    for k in sorted({1, os.cpu_count() or 1}):
        print(f"  {k} thread(s): {pool_rate(jpeg, k, 20 * k):6.1f} frames/s")
    decode_resize = dict(library_rows(jpeg, args.repeat))["OpenCV decode + resize (ppipe's)"]
    verdict = "met" if decode_resize <= TARGET_MS else "NOT met"
    print(f"\nbench_images: 1080p decode + resize to 800 x 1333 {decode_resize:.2f} ms of one core (target {TARGET_MS:g} ms: {verdict})")


if __name__ == "__main__":
    main()
