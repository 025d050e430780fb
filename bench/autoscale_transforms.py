"""A heavy image transform for bench/autoscale.py: the demo image transform plus
`OVERLORD_BENCH_HEAVY_MS` of latency per sample that does not hold the GIL, the way
decoding from remote storage or a native decoder does. Text stays cheap (~0.03 ms), so
the sources' costs span over 100x."""

import os
import time

from overlord.transforms import resolve

_LATENCY_S = float(os.environ.get("OVERLORD_BENCH_HEAVY_MS", "5")) / 1000
_image = None


def heavy_image(row):
    global _image
    if _image is None:
        from overlord.demo.corpus import IMAGE_TRANSFORM

        _image = resolve(IMAGE_TRANSFORM)
    time.sleep(_LATENCY_S)
    return _image(row)
