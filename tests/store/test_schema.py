"""The one Redis schema: the reference is current, covers every key, and nobody formats a field by hand."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from overlord.store import Keys, schema

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("redis_reference", ROOT / "tools" / "redis_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_redis_reference_is_current(tool, capsys):
    rc = tool.main(["--check"])
    assert rc == 0, capsys.readouterr().err  # stale: run python tools/redis_reference.py


def test_schema_describes_every_key_and_matches_the_key_names():
    keys = Keys("j")
    built = {n for n in dir(Keys) if not n.startswith("_")} - {"job", "base", "pattern", "heartbeat_pattern"}
    assert {k.attr for k in schema.SCHEMA} == built
    for k in schema.SCHEMA:
        value = getattr(keys, k.attr)
        if callable(value):  # fill the <placeholders> in order
            args = re.findall(r"<(\w+)>", k.suffix)
            value = value(*args)
            expected = re.sub(r"<(\w+)>", lambda m: m.group(1), k.suffix)
        else:
            expected = k.suffix
        assert value == f"overlord:{{j}}:{expected}"


def test_fields_and_encodings_are_byte_identical_to_what_runs_today():
    assert [schema.built_field(3), schema.consumed_field(3), schema.replay_field(3)] == ["c3", "t3", "r3"]
    assert [schema.position_field(1), schema.skip_field(1), schema.rewind_field(1)] == [
        "position:1",
        "skip:1",
        "rewind:1",
    ]
    assert schema.trainer_stats_field(2) == "rank2" and schema.truncated_field(0) == "truncated:c0"
    assert schema.encode_position((4, 1)) == "[4, 1]"
    assert schema.encode_rewind(7, (4, 1)) == '{"pid": 7, "at": [4, 1]}'
    request = schema.replay_request(12, 9)
    assert re.fullmatch(r"12\.\d+\.\d{6}:9", request) and schema.replay_step(request.encode()) == "9"
    progress = {b"c0": b"5", b"t0": b"6", b"r1": request.encode()}
    assert schema.built(progress, 0, -1) == 5 and schema.built(progress, 1, -1) == -1
    assert schema.replay(progress, 1) == request.encode() and schema.replay(progress, 0) is None
    resume = {b"step": b"4", b"position:0": b"[4, 1]", b"skip:0": b"3", b"rewind:1": b"{}"}
    assert schema.positions(resume, 2) == {0: [4, 1]}
    assert schema.skips(resume, [0, 1]) == {0: 3, 1: 0}
    assert [schema.rank_of(k) for k in resume if schema.is_rewind_field(k)] == [1]


# A field or key string formatted outside overlord/store/: the prefixes of the schema's
# numbered fields (c<dp>, t<dp>, r<dp>, position:<rank>, ...) opening an f-string, or a key
# fragment. Matched on string literals of the AST, so prose in comments does not count.
_FIELD_FSTRING = re.compile(r"^(c|t|r|rank|position:|skip:|rewind:|truncated:c|hb:|meta:|plan:)$")
_KEY_FRAGMENT = re.compile(r"overlord:\{|^(position|skip|rewind):$")


def _hand_formatted(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), str(path))
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and len(node.values) >= 2:
            head, nxt = node.values[0], node.values[1]
            if (
                isinstance(head, ast.Constant)
                and isinstance(nxt, ast.FormattedValue)
                and _FIELD_FSTRING.match(str(head.value))
                and len(node.values) == 2  # the whole string is the field: f"c{dp}", not a message
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: f{head.value!r}{{...}}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and id(node) not in parts:
            text = node.value.decode(errors="replace") if isinstance(node.value, bytes) else node.value
            if _KEY_FRAGMENT.search(text) and not any(c.isspace() for c in text):  # a key, not prose
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text!r}")
    return found


def test_no_module_outside_the_store_formats_a_key_or_field():
    found = [
        hit
        for path in sorted((ROOT / "overlord").rglob("*.py"))
        if "store" not in path.relative_to(ROOT / "overlord").parts[:1]
        for hit in _hand_formatted(path)
    ]
    assert not found, "format these with overlord.store.schema / Keys:\n" + "\n".join(found)


def test_the_scan_catches_what_it_is_for():
    bad = ROOT / "tests" / "store" / "_scan_sample.py"
    bad.write_text(
        'dp = rank = 0\na = f"c{dp}"\nb = f"position:{rank}"\nc = "overlord:{job}:x"\nd = f"loss {dp}"\ne = "see overlord:{job}:x"\n'
    )
    try:
        hits = _hand_formatted(bad)
    finally:
        bad.unlink()
    assert len(hits) == 3, hits
