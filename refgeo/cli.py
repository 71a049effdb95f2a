"""The ``refgeo`` command (populated by the CLI issue)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``refgeo`` console script."""
    import refgeo

    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "config":
        refgeo.show_config()
        return 0
    print("usage: refgeo config", file=sys.stderr)
    return 2
