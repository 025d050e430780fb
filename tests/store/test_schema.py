"""The one Redis schema: the reference is current, covers every key, and nobody formats a field by hand."""

from __future__ import annotations

import ast
import importlib.util
import re
import struct
import time
from pathlib import Path

import pytest

from overlord.store import Keys, catalog, schema

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
    assert {k.attr for k in catalog.SCHEMA} == built
    for k in catalog.SCHEMA:
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
    assert schema.rewinds({b"rewind:1": schema.encode_rewind(7, (4, 1)).encode(), b"step": b"4"}) == {1: 7}


def test_fixed_fields_are_byte_identical_to_what_runs_today():
    s = schema
    planner = [
        s.PLANNER_STEP,
        s.PLANNER_UPDATED,
        s.PLANNER_DONE,
        s.PLANNER_TOKEN,
        s.PLANNER_LEASE,
        s.PLANNER_LEADER_SINCE,
        s.PLANNER_PRESSURE,
        s.PLANNER_NODE_PRESSURE,
    ]
    assert planner == ["step", "updated", "done", "token", "lease", "leader_since", "pressure", "node_pressure"]
    assert [s.RESUME_STEP, s.COUNTER_DROPPED_LAST, s.COUNTER_OVER_BUDGET] == [
        "step",
        "dropped_last",
        "over_budget_intervals",
    ]
    assert [s.loader_stats_field(1), s.skipped_field("a.0")] == ["loader1", "skipped:a.0"]
    assert [
        s.skipped_file_field("a.0", "x:/f"),
        s.skipped_groups_field("a.0", "f"),
        s.skipped_rows_field("a.0", "f"),
    ] == [
        "skipped_file:a.0:x:/f",
        "skipped_groups:a.0:f",
        "skipped_rows:a.0:f",
    ]
    assert s.skipped_file_of(b"skipped_file:a.0:x:/f") == ("whole", "a.0", "x:/f")
    assert s.skipped_file_of("skipped_rows:a.0:f") == ("rows", "a.0", "f") and s.skipped_file_of("skipped:a.0") is None


def test_stream_entries_are_byte_identical_to_what_runs_today():
    s = schema
    assert s.built_entry(2, 7) == {"c": 2, "v": 7} and s.consumed_entry(2, 8) == {"t": 2, "v": 8}
    assert s.progressed_mark({b"c": b"2", b"v": b"7"}) == ("c2", 7)
    assert s.progressed_mark({b"t": b"3"}) == ("t3", None)  # a writer that did not carry the value
    assert list(s.plans_entry(5, True).items()) == [("step", 5), ("last", 1)]
    assert s.plans_entry(5, False)["last"] == 0
    assert s.plans_entry_id(5) == "6-0" and s.plans_after(5) == "5-0"
    assert list(s.promotion_entry(1, 42, "n1", b"", "lapsed", now=9.5).items()) == [
        ("loader", 1),
        ("pid", 42),
        ("node", "n1"),
        ("previous", b""),
        ("time", 9.5),
        ("reason", "lapsed"),
    ]
    assert list(s.move_entry("loader0", "a", "b", "home", now=9.5).items()) == [
        ("unit", "loader0"),
        ("from", "a"),
        ("to", "b"),
        ("reason", "home"),
        ("time", 9.5),
    ]
    assert list(s.scaling_entry(3, "src", 2, rate=1.5, demand=0.25, cost_ms=0.1, now=9.5).items()) == [
        ("step", 3),
        ("source", "src"),
        ("workers", 2),
        ("rate", 1.5),
        ("demand", 0.25),
        ("cost_ms", 0.1),
        ("time", 9.5),
    ]
    assert abs(s.promotion_entry(1, 42, "n1", b"", "lapsed")["time"] - time.time()) < 60
    assert s.log_entries([(b"1-0", {b"unit": b"u", b"time": b"9.5"})]) == [{"unit": "u", "time": "9.5"}]


def test_meta_entries_are_byte_identical_to_what_runs_today():
    arrays = {"seq": [1, 2], "tokens": [3, 4], "patches": [0, 5], "nbytes": [6, 7]}
    entry = schema.meta_entry(arrays, 2, [(1, 10)], True, 9)
    assert entry == {
        "seq": struct.pack("<2q", 1, 2),
        "tokens": struct.pack("<2i", 3, 4),
        "patches": struct.pack("<2i", 0, 5),
        "nbytes": struct.pack("<2q", 6, 7),
        "epoch": b"2",
        "ended": b"[[1, 10]]",
        "final": b"1",
        "token": b"9",
    }
    assert list(entry) == ["seq", "tokens", "patches", "nbytes", "epoch", "ended", "final", "token"]
    back = schema.meta_fields({k.encode(): v for k, v in entry.items()})
    assert {k: list(v) for k, v in back.items() if k in schema.META_ARRAYS} == arrays
    assert (back["epoch"], back["ended"], back["final"], back["token"]) == (2, [(1, 10)], True, 9)
    with pytest.raises(ValueError, match="disagree"):
        schema.meta_fields({k.encode(): v for k, v in {**entry, "seq": struct.pack("<q", 1)}.items()})


def test_value_encodings_are_byte_identical_to_what_runs_today():
    s = schema
    assert s.encode_node_pressure({"b": 1.23456, "a": 0.5}) == '{"a": 0.5, "b": 1.235}'
    assert s.encode_record({"pid": 1, "ranks": [0, 1]}) == '{"pid": 1, "ranks": [0, 1]}'
    assert s.json_records({b"n1": b'{"pid": 1}'}) == {"n1": {"pid": 1}}
    assert s.encode_checkpoint({"step": 3, "cursors": {"a": [0, 1]}}) == '{"step":3,"cursors":{"a":[0,1]}}'
    assert s.decode_checkpoint(b'{"step":3}') == {"step": 3}
    assert s.counter_values({b"dropped_last": b"4"}) == {"dropped_last": 4}
    assert s.resume_fields({b"step": b"4", b"position:0": b"[4, 1]"}) == {"step": 4, "position:0": [4, 1]}
    state = s.planner_state(
        {b"step": b"7", b"done": b"1", b"token": b"3", b"pressure": b"1.5", b"node_pressure": b'{"a": 0.5}'}
    )
    assert state == s.PlannerState(step=7, done=True, token=3, pressure=1.5, node_pressure={"a": 0.5})
    assert s.planner_state({}) == s.PlannerState(step=None, done=False, token=None, pressure=None, node_pressure={})
    stats = {b"loader0": b"{}", b"rank3": b"{}"}
    assert [s.is_loader_stats_field(k) for k in stats] == [True, False]
    assert [s.stats_rank(k) for k in stats if s.is_trainer_stats_field(k)] == [3]
    assert [s.dp_of(b"c12"), s.dp_of("t3"), s.dp_of("r0")] == [12, 3, 0]


def test_the_reference_spells_fields_with_the_constants():
    fields = {k.attr: [f.name for f in k.fields] for k in catalog.SCHEMA}
    assert fields["planner"][0] == schema.PLANNER_STEP and schema.PLANNER_NODE_PRESSURE in fields["planner"]
    assert fields["plans"] == [", ".join(schema.PLANS_FIELDS)]
    assert fields["scaling"] == [", ".join(schema.SCALING_FIELDS)]
    assert fields["promotions"] == [", ".join(schema.PROMOTION_FIELDS)]
    assert fields["placements"] == [", ".join(schema.MOVE_FIELDS)]
    assert schema.RESUME_STEP in fields["resume"] and schema.COUNTER_DROPPED_LAST in fields["counters"]


# A field or key string formatted outside overlord/store/: the prefixes of the schema's
# numbered fields (c<dp>, t<dp>, r<dp>, position:<rank>, ...) opening an f-string, or a key
# fragment. Matched on string literals of the AST, so prose in comments does not count.
_FIELD_FSTRING = re.compile(
    r"^(c|t|r|rank|position:|skip:|rewind:|asked:|stopped:|truncated:c|skipped:|skipped_file:|skipped_groups:|skipped_rows:|hb:|meta:|plan:)$"
)
_KEY_FRAGMENT = re.compile(r"overlord:\{|^(position|skip|rewind):$")

# Hash commands and where their field names go: the positional arguments from this index
# on (None: the one at index 1 only), and the keywords that name fields.
_HASH_FIELDS = {
    "hget": (None, ("key",)),
    "hset": (None, ("key",)),
    "hsetnx": (None, ("key",)),
    "hexists": (None, ("key",)),
    "hincrby": (None, ("key",)),
    "hincrbyfloat": (None, ("key",)),
    "hdel": (1, ()),
    "hmget": (1, ("keys",)),
}


def _literals(node: ast.AST | None) -> list[ast.Constant]:
    """The string literals `node` is or holds as a list/tuple of field names."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [c for e in node.elts for c in _literals(e)]
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
        return [node]
    return []


def _dict_keys(node: ast.AST | None) -> list[ast.Constant]:
    """The string literal keys of a dict display (a mapping of fields, a stream entry)."""
    if isinstance(node, ast.Dict):  # a `**spread` has no key: look into what it spreads
        return [c for k, v in zip(node.keys, node.values) for c in (_literals(k) if k else _dict_keys(v))]
    if isinstance(node, ast.IfExp):
        return _dict_keys(node.body) + _dict_keys(node.orelse)
    return []


def _literal_fields(call: ast.Call) -> list[ast.Constant]:
    """String literals a Redis call takes as hash fields or stream entry fields."""
    if not isinstance(call.func, ast.Attribute):
        return []
    name, kw = call.func.attr, {k.arg: k.value for k in call.keywords}
    if name in _HASH_FIELDS:
        start, keywords = _HASH_FIELDS[name]
        args = call.args[1:2] if start is None else call.args[start:]
        found = [c for a in args for c in _literals(a)] + [c for k in keywords for c in _literals(kw.get(k))]
        if name == "hset":
            found += _dict_keys(kw.get("mapping")) + _dict_keys(call.args[3] if len(call.args) > 3 else None)
        return found
    if name == "xadd":
        return _dict_keys(call.args[1] if len(call.args) > 1 else kw.get("fields"))
    return []


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
        elif isinstance(node, ast.Call):
            for field in _literal_fields(node):
                found.append(f"{path.relative_to(ROOT)}:{field.lineno}: field {field.value!r}")
    return found


def test_no_module_outside_the_store_formats_a_key_or_field():
    found = [
        hit
        for path in sorted((ROOT / "overlord").rglob("*.py"))
        if "store" not in path.relative_to(ROOT / "overlord").parts[:1]
        for hit in _hand_formatted(path)
    ]
    assert not found, "name these with overlord.store.schema / Keys:\n" + "\n".join(found)


def test_the_scan_catches_what_it_is_for():
    bad = ROOT / "tests" / "store" / "_scan_sample.py"
    bad.write_text(
        "dp = rank = 0\n"
        'a = f"c{dp}"\n'
        'b = f"position:{rank}"\n'
        'c = "overlord:{job}:x"\n'
        'd = f"loss {dp}"\n'  # a message, not a field
        'e = "see overlord:{job}:x"\n'  # prose
        'r.hget(k, "done")\n'
        'r.hset(k, "step", 1)\n'
        'pipe.hset(k, mapping={"token": 1, FIELD: 2, **({"done": 1} if last else {})})\n'
        'pipe.hincrby(k, "over_budget_intervals", 1)\n'
        'r.hdel(k, "a", b"b")\n'
        'r.hmget(k, ["x", "y"])\n'
        'r.hget(name=k, key="done")\n'
        'pipe.xadd(k, {"c": dp}, maxlen=10)\n'
        'pipe.xadd(k, fields={"t": dp})\n'
        "r.hget(k, FIELD)\n"  # a name from the schema: fine
        "r.hset(k, field(dp), 1)\n"
        "r.hset(k, mapping=mapping)\n"
        "pipe.xadd(k, entry(dp))\n"
        'r.get("done")\n'  # not a hash command
        'd = {"step": 1}\n'  # a dict that is no command's fields
    )
    try:
        hits = _hand_formatted(bad)
    finally:
        bad.unlink()
    fields = [h.split(": field ", 1)[1] for h in hits if ": field " in h]
    assert len(hits) - len(fields) == 3, hits
    assert fields == [
        "'done'",
        "'step'",
        "'token'",
        "'done'",
        "'over_budget_intervals'",
        "'a'",
        "b'b'",
        "'x'",
        "'y'",
        "'done'",
        "'c'",
        "'t'",
    ], hits


def test_a_trainers_note_fits_a_ring_note_whatever_its_counts():
    from overlord.shm._note import NOTE_BYTES

    most = {
        "batches": 2**63,
        "wait_s": 1.2345678e300,
        "dropped": 2**63,
        "copies": 2**63,
        "step": -(2**63),
        "done": False,
    }
    note = schema.encode_trainer_note(2**22, most)
    assert len(note) <= NOTE_BYTES, len(note)
    record = schema.decode_record(schema.note_record(note, "node0"))
    assert record["node"] == "node0" and record["pid"] == 2**22 and record["batches"] == 2**63
    assert schema.note_record(b"not json", "node0") is None and schema.note_record(b"[1]", "node0") is None
