"""Expand a Tempita template (``foo.pyx.tp`` -> ``foo.pyx``) for the meson build.

Usage: ``python tempita.py INPUT -o OUTDIR``.  Cython ships Tempita, so the build
needs nothing beyond its own build requirements.
"""

import argparse
import os

from Cython import Tempita


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("infile")
    parser.add_argument("-o", "--outdir", required=True)
    args = parser.parse_args()
    with open(args.infile, encoding="utf-8") as f:
        template = Tempita.Template(f.read(), name=args.infile)
    base = os.path.basename(args.infile)
    assert base.endswith(".tp"), base
    out = os.path.join(args.outdir, base[: -len(".tp")])
    with open(out, "w", encoding="utf-8") as f:
        f.write(template.substitute())


if __name__ == "__main__":
    main()
