"""What every generated reference's tool does with the text it renders: write it to its
file, or with --check exit 1 when the committed file is not that text (stale)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shown(path: Path) -> str:
    """`path` relative to the checkout when it is inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def run(tool: str, out: Path, render: Callable[[], str], argv: list[str] | None, doc: str) -> int:
    """The command line of `tools/<tool>.py`: --check, --out; returns the exit status."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the reference is not what this renders")
    parser.add_argument("--out", type=Path, default=out, help=f"where to write (default: {shown(out)})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if (args.out.read_text() if args.out.exists() else None) != text:
            print(f"{tool}: {shown(args.out)} is stale; run python tools/{tool}.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {shown(args.out)}")
    return 0
