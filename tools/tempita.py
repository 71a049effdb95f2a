"""Expand a Tempita template (``foo.pyx.tp`` -> ``foo.pyx``) for the meson build.

Usage: ``python tempita.py INPUT -o OUTDIR``.  Cython ships Tempita, so the build
needs nothing beyond its own build requirements.

Every template of ``refgeo_ext`` sees one name, ``VARIANTS``: the one tuple layout of
the compiled variants, written down here once so that the kernels cannot drift apart.
Each tuple is ``(suffix, T, dtype, u, ST, t, st, mixed)``:

``suffix``
    name suffix of the generated functions and classes (``knn64``, ``knn32s64``).
``T``
    C type of the array the kernel streams: the centered copy fed to the GEMM, or the
    logits of the tropical kernel.
``dtype``
    NumPy dtype of ``T``.
``u``
    unit roundoff of ``T`` (the rounding bound itself is computed in Python).
``ST``
    C type of the source rows that candidates are refined from in float64.
``t``, ``st``
    helper suffix (``f64``/``f32``) of ``T`` (``_blas.pxd``, ``src/tropical.h``) and of
    ``ST`` (``src/refine.h``).
``mixed``
    True for ``32s64``: float64 rows filtered through a float32 centered copy (half
    the GEMM time) and refined from float64.  Kernels without a refinement step (the
    tropical reduction) skip these variants.
"""

import argparse
import os

from Cython import Tempita

VARIANTS = [
    ("64", "double", "float64", "0x1p-53", "double", "f64", "f64", False),
    ("32", "float", "float32", "0x1p-24", "float", "f32", "f32", False),
    ("32s64", "float", "float32", "0x1p-24", "double", "f32", "f64", True),
]


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
        f.write(template.substitute(VARIANTS=VARIANTS))


if __name__ == "__main__":
    main()
