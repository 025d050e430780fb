"""overlord.transforms_hf.Tokenize with tokenizers trained here on their own corpus:
ids that decode back to the text, BOS/EOS, truncation to context_length, the same bytes
in another process and on any number of worker threads, and errors that say what to set."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from overlord.config import Source
from overlord.errors import ConfigError, SourceReadError
from overlord.loader.source_loader import SourceLoader
from overlord.transforms_hf import Tokenize

datasets.disable_progress_bars()

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a data loader reads every sample exactly once per epoch",
    "shared memory rings carry micro-batches to the trainer",
    "héllo wörld, ça va? 123 456 — naïve café",
] * 30
TEXTS = [  # not all in the corpus: byte-level BPE still encodes and decodes them exactly
    "the lazy fox reads a ring",
    "",
    "zebra quartz 789 ümlaut ✓",
    "exactly once per epoch, every sample " * 20,
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer trained on CORPUS, with <s> and </s>, as tokenizer.json."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory):
    """A WordPiece tokenizer trained on CORPUS, with BERT's [CLS] and [SEP]."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    )
    path = tmp_path_factory.mktemp("wp") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_ids_decode_back_to_the_text_between_bos_and_eos(bpe):
    t = Tokenize(tokenizer=bpe)
    tok = Tokenizer.from_file(bpe)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    for text in TEXTS:
        ids = t({"text": text})["input_ids"]
        assert ids.dtype == np.int32 and ids[0] == bos and ids[-1] == eos
        assert tok.decode(ids[1:-1].tolist()) == text
        assert bos not in ids[1:-1] and eos not in ids[1:-1]
    assert len(t({"text": TEXTS[3]})["input_ids"]) < len(TEXTS[3].encode()) / 3, "merged subwords, not bytes"


def test_batch_is_each_row_alone(bpe):
    t = Tokenize(tokenizer=bpe, dtype="int64")
    rows = [{"text": s, "other": 1} for s in TEXTS]
    batched = t.batch(rows)
    assert [b["input_ids"].tobytes() for b in batched] == [t(r)["input_ids"].tobytes() for r in rows]
    assert {b["input_ids"].dtype for b in batched} == {np.dtype(np.int64)}


def test_truncation_keeps_bos_and_eos_and_the_start_of_the_text(bpe):
    full = Tokenize(tokenizer=bpe)({"text": TEXTS[3]})["input_ids"]
    for limit in (3, 8, len(full) - 1):
        cut = Tokenize(tokenizer=bpe, context_length=limit)({"text": TEXTS[3]})["input_ids"]
        assert len(cut) == limit and cut[0] == full[0] and cut[-1] == full[-1]
        assert cut[1:-1].tolist() == full[1 : limit - 1].tolist()
    short = Tokenize(tokenizer=bpe, context_length=len(full))({"text": TEXTS[3]})["input_ids"]
    assert short.tobytes() == full.tobytes(), "a text that fits is not cut"


def test_special_tokens_from_config_ids_or_none(bpe, wordpiece, tmp_path):
    tok = Tokenizer.from_file(wordpiece)
    ids = Tokenize(tokenizer=wordpiece)({"text": "the quick fox"})["input_ids"]  # auto: BERT's [CLS] ... [SEP]
    assert ids[0] == tok.token_to_id("[CLS]") and ids[-1] == tok.token_to_id("[SEP]")
    assert tok.decode(ids[1:-1].tolist()) == "the quick fox"
    plain = Tokenize(tokenizer=bpe, bos=None, eos=None)({"text": "the fox"})["input_ids"]
    assert Tokenizer.from_file(bpe).decode(plain.tolist()) == "the fox"
    assert Tokenize(tokenizer=bpe, bos=0, eos="<unk>")({"text": "fox"})["input_ids"][[0, -1]].tolist() == [0, 1]
    # a model repository's tokenizer_config.json names them (null: none)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "tokenizer.json").write_text(open(bpe).read())
    (repo / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<pad>"}, "eos_token": None}))
    ids = Tokenize(tokenizer=str(repo))({"text": "fox"})["input_ids"]  # the directory holding tokenizer.json
    assert ids[0] == 0 and Tokenizer.from_file(bpe).decode(ids[1:].tolist()) == "fox"


def test_the_same_bytes_in_another_process(bpe):
    mine = [Tokenize(tokenizer=bpe, context_length=16)({"text": s})["input_ids"].tobytes().hex() for s in TEXTS]
    code = (
        "import sys, json; from overlord.transforms_hf import Tokenize;"
        "t = Tokenize(tokenizer=sys.argv[1], context_length=16);"
        "print(json.dumps([t({'text': s})['input_ids'].tobytes().hex() for s in json.loads(sys.argv[2])]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, bpe, json.dumps(TEXTS)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == mine


def test_a_source_loader_encodes_batches_on_its_workers_with_the_same_samples(bpe, tmp_path):
    texts = [f"{CORPUS[i % 4]} {i}" for i in range(90)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    source = Source(
        name="wiki",
        paths=(str(tmp_path / "ds"),),
        format="hf",
        shuffle_window=16,
        transform="overlord.transforms_hf:Tokenize",
        transform_args={"tokenizer": bpe},
    )

    def run(workers, context_length=12):
        ld = SourceLoader(source, 0, seed=3, epochs=1, context_length=context_length)
        ld.set_workers(workers)
        out = []
        while not ld.finished:
            out += ld.prepare(25)[0]
        ld.close()
        return [(s.seq, s.key, s.arrays["input_ids"].tobytes()) for s in out]

    one = run(1)
    assert run(2) == one == run(3), "the same samples, order and bytes on any number of worker threads"
    tok = Tokenizer.from_file(bpe)
    for _, key, raw in one:
        ids = np.frombuffer(raw, np.int32)
        text = texts[int(key.rsplit(":", 1)[1])]
        assert len(ids) <= 12, "truncated to the job's context_length"
        assert text.startswith(tok.decode(ids[1:-1].tolist())) and ids[-1] == tok.token_to_id("</s>")
    assert {len(np.frombuffer(raw, np.int32)) for *_, raw in run(1, context_length=None)} != {12}


# -- errors ------------------------------------------------------------------------------


def test_tokenizer_file_errors_say_what_to_set(bpe, tmp_path):
    with pytest.raises(
        ConfigError, match=r"tokenizer file '.*missing/tokenizer.json' does not exist; set transform_args.tokenizer"
    ):
        Tokenize(tokenizer=str(tmp_path / "missing" / "tokenizer.json"))
    (tmp_path / "bad.json").write_text('{"version": "1.0"}')
    with pytest.raises(
        ConfigError, match=r"'.*bad.json' is not a tokenizers tokenizer.json \(.*\); set transform_args.tokenizer"
    ):
        Tokenize(tokenizer=str(tmp_path / "bad.json"))
    with pytest.raises(
        ConfigError, match=r"bos token '<bos>' \(given\) is not in the vocabulary of '.*tokenizer.json'"
    ):
        Tokenize(tokenizer=bpe, bos="<bos>")
    with pytest.raises(ConfigError, match=r"eos=400 is outside the vocabulary"):
        Tokenize(tokenizer=bpe, eos=400)
    with pytest.raises(ConfigError, match=r"context_length=2 leaves no room for text after 2 special token\(s\)"):
        Tokenize(tokenizer=bpe, context_length=2)
    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(
        ConfigError, match=r"found no BOS token .* set transform_args.bos to a token or an id, or to null for none"
    ):
        Tokenize(tokenizer=str(tmp_path / "bare.json"))


def test_source_config_errors_name_the_source(bpe, tmp_path):
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "a.parquet")
    path = str(tmp_path / "a.parquet")
    cases = {
        (): r"source 'wiki': transform spec 'overlord.transforms_hf:Tokenize' names a class, a transform factory: give its arguments in Source.transform_args",
        (
            ("tokenizer", str(tmp_path / "nope.json")),
        ): r"source 'wiki': transform Tokenize: tokenizer file '.*nope.json' does not exist",
        (
            ("tokenizer", bpe),
            ("colum", "x"),
        ): r"source 'wiki': .*transform_args \['colum', 'tokenizer'\] do not fit it .*; it takes \['tokenizer', 'column', 'bos'",
    }
    for args, message in cases.items():
        source = Source(
            name="wiki",
            paths=(path,),
            transform="overlord.transforms_hf:Tokenize",
            transform_args=dict(args) if args else None,
        )
        with pytest.raises(ConfigError, match=message):
            SourceLoader(source, 0, seed=0, epochs=1)
    with pytest.raises(ConfigError, match=r"Source.transform_args must be plain data \(it crosses processes as JSON\)"):
        Source(name="wiki", paths=(path,), transform_args={"tokenizer": object()})


def test_a_row_without_text_names_source_file_row_and_column(bpe, tmp_path):
    texts = [f"row {i}" for i in range(10)]
    datasets.Dataset.from_dict({"text": texts, "body": texts}).save_to_disk(str(tmp_path / "ds"))
    nulls = datasets.Dataset.from_dict({"text": [t if i != 6 else None for i, t in enumerate(texts)]})
    nulls.save_to_disk(str(tmp_path / "nulls"))

    def drain(path, *, workers=1, **kw):
        args = {"tokenizer": bpe, **kw.pop("args", {})}
        ld = SourceLoader(
            Source(
                name="wiki",
                paths=(path,),
                format="hf",
                transform="overlord.transforms_hf:Tokenize",
                transform_args=args,
                **kw,
            ),
            0,
            seed=0,
            epochs=1,
        )
        ld.set_workers(workers)
        out = []
        while not ld.finished:
            out += ld.prepare(4)[0]
        return ld, out

    with pytest.raises(
        SourceReadError,
        match=r"source 'wiki' file '.*data-00000-of-00001.arrow' row \d+: transform "
        r"overlord.transforms_hf:Tokenize raised KeyError: .*needs a text column 'content' "
        r"but the row has \['body', 'text'\]; set transform_args.column",
    ):
        drain(str(tmp_path / "ds"), args={"column": "content"})
    for workers in (1, 2):  # the batch that holds it fails, and the row is found and named
        with pytest.raises(
            SourceReadError,
            match=r"source 'wiki' file '.*nulls/data-00000-of-00001.arrow' row 6: transform "
            r"overlord.transforms_hf:Tokenize raised TypeError: .*column 'text' must be a "
            r"string, got NoneType",
        ):
            drain(str(tmp_path / "nulls"), workers=workers)
    ld, out = drain(str(tmp_path / "nulls"), workers=2, on_error="skip")
    assert ld.skipped == 1 and sorted(s.key for s in out) == sorted(f"wiki:0:{r}" for r in range(10) if r != 6)


def test_without_the_extra_the_error_says_pip_install_overlord_hf(bpe):
    code = (
        "import sys; sys.modules['tokenizers'] = None\n"  # how Python itself spells 'not installed'
        "from overlord.transforms_hf import Tokenize\n"
        "try:\n    Tokenize(tokenizer=sys.argv[1])\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, bpe], capture_output=True, text=True, timeout=60, env=dict(os.environ)
    )
    assert "ConfigError" in out.stdout and "pip install 'overlord[hf]'" in out.stdout, out.stdout + out.stderr


def test_sources_naming_one_tokenizer_file_share_one_loaded_tokenizer(bpe, wordpiece, tmp_path):
    # a loader process hosting many sources of one tokenizer holds it once, each source
    # with its own settings
    a, b = Tokenize(tokenizer=bpe, context_length=4), Tokenize(tokenizer=os.path.dirname(bpe), bos=None, eos=None)
    assert a.tokenizer is b.tokenizer
    row = {"text": TEXTS[3]}
    assert len(a(row)["input_ids"]) == 4 and len(b(row)["input_ids"]) > 4
    assert b(row)["input_ids"].tolist() == Tokenizer.from_file(bpe).encode(TEXTS[3]).ids
    # a file rewritten with another tokenizer is loaded anew, never served from the cache
    path = tmp_path / "tokenizer.json"
    path.write_text(open(bpe).read())
    before = Tokenize(tokenizer=str(path), bos=None, eos=None)
    path.write_text(open(wordpiece).read())
    after = Tokenize(tokenizer=str(path), bos=None, eos=None)
    assert after.tokenizer is not before.tokenizer
    assert (
        after({"text": "the quick fox"})["input_ids"].tolist()
        == Tokenizer.from_file(wordpiece).encode("the quick fox", add_special_tokens=False).ids
    )
