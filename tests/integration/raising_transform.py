"""A transform module that raises when imported (an import-time bug in a user's module)."""

raise RuntimeError("this transform module is broken at import")


def text(row):  # never reached
    return row
