"""Transforms that hang or end their process on one row (Source Loaders load them as
module:factory with transform_args, in their own processes): the row is the one whose
text is `text`; every other row is tokenized as overlord.transforms:text does."""

from __future__ import annotations

import os
import signal
import threading

from overlord.transforms import text as tokenize


def hang_on(text: str):
    """Sleeps forever on the row with this text."""

    def transform(row):
        if row["text"] == text:
            threading.Event().wait()
        return tokenize(row)

    return transform


def exit_on(text: str, status: int = 3):
    """os._exit(status) on the row with this text (no exception, no error record)."""

    def transform(row):
        if row["text"] == text:
            os._exit(status)
        return tokenize(row)

    return transform


def kill_on(text: str):
    """SIGKILLs its own process on the row with this text (as the OOM killer would)."""

    def transform(row):
        if row["text"] == text:
            os.kill(os.getpid(), signal.SIGKILL)
        return tokenize(row)

    return transform
