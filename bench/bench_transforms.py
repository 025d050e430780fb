"""Transforms with a set cost, for benchmarks (the sidecar imports them from bench/ on
PYTHONPATH):

- `costly_text`: the text transform plus `OVERLORD_BENCH_TRANSFORM_MS` of busy CPU per
  sample, like a tokenizer (bench/failover.py `--transform-ms`): a Source Loader that
  restarts must redo that work, which a Shadow Loader has done already;
- `heavy_image`: the demo image transform plus `OVERLORD_BENCH_HEAVY_MS` of latency that
  does not hold the GIL, like decoding from remote storage or a native decoder
  (bench/autoscale.py): next to text at ~0.03 ms, costs span over 100x.
"""

import os
import time

from overlord.demo.corpus import IMAGE_TRANSFORM, TEXT_TRANSFORM
from overlord.transforms import resolve

_CPU_S = float(os.environ.get("OVERLORD_BENCH_TRANSFORM_MS", "0")) / 1000
_LATENCY_S = float(os.environ.get("OVERLORD_BENCH_HEAVY_MS", "5")) / 1000
_text, _image = resolve(TEXT_TRANSFORM), resolve(IMAGE_TRANSFORM)


def costly_text(row):
    end = time.perf_counter() + _CPU_S
    while time.perf_counter() < end:  # busy: a sleep would not load the CPU
        pass
    return _text(row)


def heavy_image(row):
    time.sleep(_LATENCY_S)
    return _image(row)
