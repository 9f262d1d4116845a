"""Segment's CPU stages on this machine's CPU, on a 1920x1080 image: drawing the model's outline and cropping for the
refiner (resvg, OpenCV), then cleaning and outlining the refined mask (OpenCV). Median of 20 runs each.

    python benchmarks/experiments/segment_cpu_stages.py [--out cpu_stages.json]
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kestrel_backend.runtime import segment_refiner  # noqa: E402


def median_ms(fn, n=20):
    times, out = [], None
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1000)
    return out, round(sorted(times)[n // 2], 2)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    box = {"x_min": 0.3, "y_min": 0.2, "x_max": 0.7, "y_max": 0.8}
    path = "M 0.1 0.1 C 0.5 -0.1 0.9 0.2 0.95 0.5 C 0.9 0.9 0.4 1 0.1 0.9 Z"
    crop, crop_ms = median_ms(lambda: segment_refiner._crop(image, path, box))
    yy, xx = np.mgrid[:378, :378]
    soft = (1 / (1 + np.exp(((yy - 189) ** 2 + (xx - 189) ** 2) / 120.0 ** 2 * 8 - 8))).astype(np.float32)  # a blob
    _, outline_ms = median_ms(lambda: segment_refiner._outline(soft, crop))
    res = {"cpu": platform.processor() or platform.machine(), "image": "1920x1080", "draw_and_crop_ms": crop_ms,
           "clean_and_outline_ms": outline_ms}
    print(json.dumps(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
