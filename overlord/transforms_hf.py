"""A sample transform on a Hugging Face `tokenizers` tokenizer (its ``tokenizer.json``).

    sources:
      - name: wiki
        format: hf
        paths: [/data/wiki/train]
        transform: overlord.transforms_hf:Tokenize
        transform_args: {tokenizer: /models/llama3/tokenizer.json}   # column: text, bos/eos: auto

Each row's text becomes ``{"input_ids": int32 [n]}`` (int64 with ``dtype: int64``): BOS,
the text's ids, EOS, at most ``context_length`` ids in all (the job's
``BatchSpec.context_length`` unless set), as `overlord.transforms.text` lays them out.

- Batches: the Source Loader hands `Tokenize.batch` a run of rows per worker thread,
  encoded in one ``encode_batch_fast`` call, which releases the GIL, so worker threads
  encode in parallel. tokenizers' own thread pool is turned off
  (``TOKENIZERS_PARALLELISM=false`` unless the environment sets it): it would take every
  core of the machine in each loader process, while the loader's workers are what the
  CPU budget and the autoscaler size.
- Special tokens: the tokenizer's post-processor template is not applied
  (``add_special_tokens=False``); this transform places BOS and EOS itself. ``bos`` and
  ``eos`` are a token (``"<s>"``), an id, null (none), or ``auto`` (default): the
  ``bos_token``/``eos_token`` of a ``tokenizer_config.json`` beside ``tokenizer.json`` (a
  model repository's; null there means none), else the first of the well-known names
  below among the tokenizer's special tokens, else a ConfigError that says to set it.
- Truncation keeps BOS and EOS and cuts the text's ids (as tokenizers' own truncation
  keeps a template's special tokens).
- Deterministic: ids depend on the text and the tokenizer file only, in any process.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

import numpy as np

from overlord.errors import ConfigError

log = logging.getLogger("overlord.transforms")

AUTO_BOS = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<|endoftext|>")
AUTO_EOS = ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "[SEP]")
DTYPES = {"int32": np.int32, "int64": np.int64}


# One loaded tokenizer per file and process, shared by every source that names it: a
# loader process hosting 150 sources held 150 copies of the same tokenizer (1.9 MiB each
# for an 8k-id BPE, tens of MiB for a 128k-id one). A Tokenizer is never changed after
# loading (encode_batch_fast reads it), so sharing it cannot mix sources' settings; the
# key has the file's identity, so a rewritten file is loaded anew.
_LOADED: dict[tuple[str, int, int, int], tuple[str, Any]] = {}
_LOADING = threading.Lock()


def _load(path: str):
    """The tokenizers.Tokenizer in `path` (a tokenizer.json, or a directory holding one),
    loaded once per process (`_LOADED`)."""
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    try:
        st = os.stat(path)
    except OSError:
        return _read(path)  # says what is missing
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with _LOADING:
        if key not in _LOADED:
            _LOADED[key] = _read(path)
        return _LOADED[key]


def _read(path: str):
    try:
        # deferred: tokenizers, an optional extra (overlord[hf]), needed only by the sources that use it
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            "transform overlord.transforms_hf:Tokenize needs the tokenizers package: pip install 'overlord[hf]'"
        ) from None
    if not os.path.isfile(path):
        raise ConfigError(
            f"transform Tokenize: tokenizer file {path!r} does not exist; set transform_args.tokenizer to a "
            "tokenizer.json (a model repository's, or one written by tokenizers' Tokenizer.save)"
        )
    try:
        return path, Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        hint = (
            " (a SentencePiece .model: save its tokenizer.json with transformers' tokenizer.save_pretrained)"
            if path.endswith(".model")
            else ""
        )
        raise ConfigError(
            f"transform Tokenize: {path!r} is not a tokenizers tokenizer.json ({exc}){hint}; "
            "set transform_args.tokenizer to one"
        ) from None


def _configured(path: str, side: str) -> tuple[bool, str | None]:
    """(found, token) for `side` ("bos"/"eos") in tokenizer_config.json beside `path`."""
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    try:
        with open(config, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return False, None
    key = f"{side}_token"
    if not isinstance(data, dict) or key not in data:
        return False, None
    token = data[key]
    return True, token.get("content") if isinstance(token, dict) else token


class Tokenize:
    """Tokenizes a text column with a Hugging Face tokenizer; see the module docstring.

    Args:
        tokenizer: path of a tokenizer.json (or of the directory holding it).
        column: the text column.
        bos, eos: a token, an id, None (none) or "auto".
        context_length: most ids per sample, BOS and EOS included; None: no limit.
        dtype: "int32" or "int64".

    Raises:
        ConfigError: the tokenizer file is missing or not a tokenizer, a special token is
            not in its vocabulary, or an argument is out of range.
    """

    def __init__(
        self,
        *,
        tokenizer: str,
        column: str = "text",
        bos: str | int | None = "auto",
        eos: str | int | None = "auto",
        context_length: int | None = None,
        dtype: str = "int32",
    ) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the loader's workers are the parallelism
        self.path, self.tokenizer = _load(os.path.expanduser(str(tokenizer)))
        self.column = column
        if dtype not in DTYPES:
            raise ConfigError(f"transform Tokenize: dtype={dtype!r}; use one of {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype]
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos = self._special("bos", bos, AUTO_BOS)
        self.eos = self._special("eos", eos, AUTO_EOS)
        self.specials = (self.bos is not None) + (self.eos is not None)
        if context_length is not None and (not isinstance(context_length, int) or context_length <= self.specials):
            raise ConfigError(
                f"transform Tokenize: context_length={context_length!r} leaves no room for text after "
                f"{self.specials} special token(s); raise it"
            )
        self.limit = None if context_length is None else context_length - self.specials
        log.info("tokenizer %s: bos %s, eos %s, at most %s ids a sample", self.path, self.bos, self.eos, context_length)

    def _special(self, side: str, value: str | int | None, names: tuple[str, ...]) -> int | None:
        """The id `value` names for BOS or EOS (`side`), or None."""
        found = "given"
        if value == "auto":
            configured, value = _configured(self.path, side)
            found = "from tokenizer_config.json"
            if not configured:
                specials = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
                value = next((n for n in names if n in specials), None)
                found = "among its special tokens"
                if value is None:
                    raise ConfigError(
                        f"transform Tokenize: found no {side.upper()} token for {self.path!r} (no tokenizer_config.json "
                        f"beside it names one; none of {list(names)} among its special tokens {sorted(specials)}); set "
                        f"transform_args.{side} to a token or an id, or to null for none"
                    )
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"transform Tokenize: {side}={value!r} must be a token, an id, null or 'auto'")
        if isinstance(value, int):
            if not 0 <= value < self.vocab:
                raise ConfigError(
                    f"transform Tokenize: {side}={value} is outside the vocabulary of {self.path!r} (0..{self.vocab - 1})"
                )
            return value
        token_id = self.tokenizer.token_to_id(value)
        if token_id is None:
            raise ConfigError(
                f"transform Tokenize: {side} token {value!r} ({found}) is not in the vocabulary of {self.path!r}; "
                f"set transform_args.{side} to one of its tokens, an id, or null"
            )
        return int(token_id)

    def _text(self, row: dict) -> str:
        try:
            value = row[self.column]
        except KeyError:
            raise KeyError(
                f"transform Tokenize needs a text column {self.column!r} but the row has {sorted(row)}; "
                "set transform_args.column to the text column"
            ) from None
        if not isinstance(value, str):
            raise TypeError(
                f"transform Tokenize: column {self.column!r} must be a string, got {type(value).__name__}; "
                "set transform_args.column to a text column, or fix or skip the row (on_error: skip)"
            )
        return value

    def _sample(self, ids: list[int]) -> dict[str, np.ndarray]:
        if self.limit is not None:
            ids = ids[: self.limit]
        out = np.empty(len(ids) + self.specials, dtype=self.dtype)
        at = 0
        if self.bos is not None:
            out[0] = self.bos
            at = 1
        out[at : at + len(ids)] = ids
        if self.eos is not None:
            out[-1] = self.eos
        return {"input_ids": out}

    def batch(self, rows: list[dict]) -> list[dict[str, np.ndarray]]:
        """One sample per row, from one encode_batch_fast call (which releases the GIL).

        Raises:
            KeyError: a row has no text column.
            TypeError: a row's text is not a string.
        """
        texts = [self._text(row) for row in rows]
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [self._sample(e.ids) for e in encodings]

    def __call__(self, row: dict) -> dict[str, np.ndarray]:
        """The sample of one row (what `batch` gives it)."""
        return self.batch([row])[0]


__all__ = sorted(["AUTO_BOS", "AUTO_EOS", "Tokenize"])
