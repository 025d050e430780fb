"""Render docs/config.md, the configuration reference, from the config dataclasses.

Every public dataclass of `overlord.config` (`Job`, `Source`, `Mesh`, `BatchSpec`,
`Mixing`, `Autoscale`) gets one table: field, type, default, description. Types and
defaults come from the dataclass fields; descriptions from the "Attributes:" section of
the class docstring (Google style), where an entry may run over several lines and may
name several fields at once (`flight_cert, flight_key: ...`).

A field without a description, or a description naming no field, is an error: the tool
exits 2 and names it, so the reference cannot silently fall behind the code.

    python tools/config_reference.py           # (re)write docs/config.md
    python tools/config_reference.py --check   # exit 1 if docs/config.md is stale
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/_reference.py, however this file is loaded
import _reference  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "config.md"

# where each class sits in a job's YAML; a class not named here gets no line
WHERE = {
    "Job": "The top level of a job's YAML (or `overlord.Job(...)` in Python).",
    "Source": "Each entry of `sources:` (`overlord.Source(...)`).",
    "Mesh": "`mesh:` (`overlord.Mesh(...)`).",
    "BatchSpec": "`batch:` (`overlord.BatchSpec(...)`).",
    "Mixing": "`mixing:` (`overlord.config.Mixing`, or a dict of its fields).",
    "Autoscale": "`autoscale:` (`overlord.config.Autoscale`, or a dict of its fields; `{}` for the defaults).",
}
ORDER = ("Job", "Source", "Mesh", "BatchSpec", "Mixing", "Autoscale")


_ENTRY = re.compile(r"^(?P<names>[A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*:\s*(?P<text>.*)$")


class DocError(Exception):
    """A config class whose docstring does not describe its fields one to one."""


def config_classes() -> list[type]:
    """The documented classes: the public dataclasses `overlord.config` exports."""
    import overlord.config as config

    found = [
        obj
        for name, obj in vars(config).items()
        if name in config.__all__ and inspect.isclass(obj) and dataclasses.is_dataclass(obj)
    ]
    rank = {name: i for i, name in enumerate(ORDER)}
    found.sort(key=lambda c: (rank.get(c.__name__, len(ORDER)), inspect.getsourcelines(c)[1]))
    return found


def attributes(cls: type) -> tuple[str, dict[str, str]]:
    """(summary, field -> description) from the class docstring.

    Raises:
        DocError: no docstring, or an "Attributes:" entry naming a field `cls` lacks.
    """
    doc = inspect.getdoc(cls) or ""
    if not doc or doc == _dataclass_doc(cls):
        raise DocError(f"{cls.__qualname__} has no docstring; write one with an 'Attributes:' section")
    lines = doc.splitlines()
    summary = " ".join(_paragraph(lines))
    try:
        start = lines.index("Attributes:") + 1
    except ValueError:
        return summary, {}
    entries: list[tuple[list[str], list[str]]] = []
    indent = None
    for line in lines[start:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:  # the next section ("Raises:", ...) ends this one
            break
        indent = depth if indent is None else indent
        match = _ENTRY.match(line.strip()) if depth == indent else None
        if match:
            names = [n.strip() for n in match["names"].split(",")]
            entries.append((names, [match["text"].strip()]))
        elif entries and depth > indent:
            entries[-1][1].append(line.strip())
        else:
            raise DocError(
                f"{cls.__qualname__}: cannot read the Attributes line {line.strip()!r}; "
                "write 'field: description' (or 'a, b: description'), continued with deeper indentation"
            )
    fields = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    for names, text in entries:
        for name in names:
            if name not in fields:
                raise DocError(
                    f"{cls.__qualname__} docstring describes {name!r}, which is not one of its fields "
                    f"{sorted(fields)}; fix the Attributes section"
                )
            out[name] = " ".join(text)
    return summary, out


def _paragraph(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if not line.strip():
            break
        out.append(line.strip())
    return out


def _dataclass_doc(cls: type) -> str:
    # the signature-like docstring @dataclass gives a class without one
    return cls.__name__ + str(inspect.signature(cls)).replace(" -> None", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
        text = f"`{value!r}`"
        if f.name.endswith("_bytes") and isinstance(value, int) and value >= 1 << 10:
            text += f" ({_size(value)})"
        return text
    if f.default_factory is not dataclasses.MISSING:
        made = f.default_factory()
        return f"`{type(made).__name__}()`" if dataclasses.is_dataclass(made) else f"`{made!r}`"
    return "required"


def _size(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        scale = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[unit]
        if n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The whole of docs/config.md.

    Raises:
        DocError: a field has no description, or a description names no field.
    """
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by tools/config_reference.py from the dataclasses' docstrings; do not edit.",
        "     Regenerate with: python tools/config_reference.py -->",
        "",
        "A job is declared in Python (`overlord.Job(...)`, for the trainer) or in YAML/JSON",
        "(`overlord sidecar --config job.yaml`); both build the same frozen dataclasses and",
        "validate them on construction. In YAML, `None` is `null` and tuples are lists; unknown",
        "keys are refused by name. Strategies and mixing schedules: [cookbook.md](cookbook.md).",
        "",
    ]
    missing = []
    for cls in config_classes():
        summary, described = attributes(cls)
        out += [f"## `{cls.__name__}`", "", f"`{cls.__module__}.{cls.__qualname__}`: {summary}", ""]
        if cls.__name__ in WHERE:
            out += [WHERE[cls.__name__], ""]

        out += ["| field | type | default | description |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.name not in described:
                missing.append(f"{cls.__name__}.{f.name}")
                continue
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            out.append(f"| `{f.name}` | `{_cell(kind)}` | {_cell(_default(f))} | {_cell(described[f.name])} |")
        out.append("")
    if missing:
        raise DocError(
            f"no description for {', '.join(missing)}; add each to its class docstring's 'Attributes:' section"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    try:
        return _reference.run("config_reference", OUT, render, argv, __doc__ or "")
    except DocError as exc:
        print(f"config_reference: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing
    sys.exit(main())
