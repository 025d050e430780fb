"""A text transform that costs `OVERLORD_BENCH_TRANSFORM_MS` of CPU per sample, for
bench/failover.py's `--transform-ms`: with real tokenization or image decoding, a Source
Loader that restarts must redo that work before it can serve, which a Shadow Loader
has already done."""

import os
import time

from overlord.transforms import resolve

_COST_S = float(os.environ.get("OVERLORD_BENCH_TRANSFORM_MS", "0")) / 1000
_text = None


def costly_text(row):
    global _text
    if _text is None:
        from overlord.demo.corpus import TEXT_TRANSFORM

        _text = resolve(TEXT_TRANSFORM)
    end = time.perf_counter() + _COST_S
    while time.perf_counter() < end:  # busy, like a tokenizer: a sleep would not load the CPU
        pass
    return _text(row)
