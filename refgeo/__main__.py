"""``python -m refgeo``: the refgeo command."""

from .cli import main

raise SystemExit(main())
