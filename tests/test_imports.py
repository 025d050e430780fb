"""Imports sit at the top of a module; one inside a function says why it waits.

STYLE.md: an import goes inside a function only to defer a heavy optional dependency or
to break a real cycle, with a comment saying which. The comment is
``# deferred: <what it spares, what it costs>`` or ``# cycle: <a> imports <b>``, on the
import's line or the line before it; one comment above a run of consecutive imports
(blank lines between them allowed) covers the run, and one above an ``if``/``try``/``with``
covers the imports that open its branches (``if planner: import a / else: import b``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REASON = re.compile(r"#\s*(deferred|cycle):")


def unexplained(source: str) -> list[tuple[int, str, str]]:
    """(line, function, statement) of every import inside a function of `source` with no
    reason given; the function is the innermost one around it."""
    tree = ast.parse(source)
    lines = source.splitlines()
    inner: dict[int, str] = {}  # import -> its function; ast.walk meets outer functions first
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    inner[id(node)] = fn.name
    # every import -> the first import of the run of consecutive import statements it is in
    head: dict[int, ast.stmt] = {}
    # a statement that opens a branch of a compound statement (not a def or class) -> that statement
    opens: dict[int, ast.stmt] = {}
    for parent in ast.walk(tree):
        for _, value in ast.iter_fields(parent):
            if not isinstance(value, list):
                continue
            first = None
            for stmt in value:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    first = first or stmt
                    head[id(stmt)] = first
                else:
                    first = None
            if (
                value
                and isinstance(value[0], ast.stmt)
                and isinstance(parent, ast.stmt)
                and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            ):
                opens[id(value[0])] = parent

    def says_why(lineno: int) -> bool:  # lineno counts from 1
        return 1 <= lineno <= len(lines) and REASON.search(lines[lineno - 1]) is not None

    def comments_above(lineno: int) -> range:
        top = lineno - 1
        while top >= 1 and lines[top - 1].lstrip().startswith("#"):
            top -= 1
        return range(top + 1, lineno)

    found = []
    for node in ast.walk(tree):
        if id(node) not in inner:
            continue
        assert isinstance(node, (ast.Import, ast.ImportFrom))
        end = node.end_lineno or node.lineno
        own = range(node.lineno, end + 1)
        above: list[int] = []
        at: ast.stmt | None = head[id(node)]
        while at is not None:  # the run's first import, then each compound statement it opens
            above.extend(comments_above(at.lineno))
            at = opens.get(id(at))
        if not any(says_why(n) for n in (*own, node.lineno - 1, *above)):
            stmt = ast.get_source_segment(source, node) or lines[node.lineno - 1].strip()
            found.append((node.lineno, inner[id(node)], stmt))
    return sorted(found)


def test_every_import_inside_a_function_says_why():
    found = []
    for path in sorted((ROOT / "overlord").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for lineno, function, stmt in unexplained(path.read_text()):
            found.append(f"{rel}:{lineno} ({function}): {stmt}")
    assert not found, (
        "imports inside functions without a reason: move each to the top of its module, or, "
        "if it defers a heavy optional dependency or breaks a real cycle, say so on its line "
        "or the line before (# deferred: <what, its cost> / # cycle: <a> imports <b>):\n  " + "\n  ".join(found)
    )


def test_the_rule_reads_comments_where_they_stand():
    source = """
import os


def top_level_is_fine():
    return os.sep


def bare():
    import json

    return json


def inline():
    import yaml  # deferred: PyYAML, for files only

    return yaml


def line_before():
    x = 1
    # cycle: overlord.plan.schedule imports overlord.config
    from overlord.plan.schedule import from_config

    return x, from_config


def a_run_under_one_comment():
    # deferred: the roles' modules, once, before the fork
    import numpy

    import PIL.Image
    import overlord.transforms

    return numpy, PIL, overlord


def a_comment_ends_the_run():
    # deferred: numpy
    import numpy

    y = 2
    import pyarrow

    return numpy, pyarrow, y


def a_comment_that_says_nothing():
    # imported here to keep it lazy
    import redis

    return redis


def nested():
    def inner():
        from overlord import (
            heap,  # deferred: pyarrow
        )
        import ctypes

        return heap, ctypes

    return inner


def branches(role):
    # deferred: each role loads only its own code
    if role == "planner":
        from overlord.planner.process import run_planner as main
    elif role == "loader":
        from overlord.loader.process import run_loader as main
    else:
        from overlord.constructor.process import run_constructors as main
    return main


def inside_a_branch(role):
    # deferred: says nothing of the import below, which does not open its branch
    if role:
        x = 1
        import lz4

        return x, lz4
    return None


# deferred: above the def, not above the import
def a_comment_above_the_def_is_not_one_above_the_import():
    import posix_ipc

    return posix_ipc


class Holder:
    def method(self):
        import zlib

        return zlib
"""
    assert [(function, stmt) for _, function, stmt in unexplained(source)] == [
        ("bare", "import json"),
        ("a_comment_ends_the_run", "import pyarrow"),
        ("a_comment_that_says_nothing", "import redis"),
        ("inner", "import ctypes"),
        ("inside_a_branch", "import lz4"),
        ("a_comment_above_the_def_is_not_one_above_the_import", "import posix_ipc"),
        ("method", "import zlib"),
    ]
