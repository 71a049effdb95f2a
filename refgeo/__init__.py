"""refgeo: the reference implementation of update geometry for language models.

A flat, NumPy-like API (every public function lives at the top level):

* Hilbert projective distance between output distributions (``refgeo.hilbert``).
* Certified row geometry of an LM-head update: diameter, closest pair, k-NN
  (``refgeo.rows``).
* The diameter LMO, projected RowNorm and head optimizers (``refgeo.lmo``,
  ``refgeo.optim``).
* Max-min spreading, the codes and lattices it starts from, and upper bounds on the
  distance ratio (``refgeo.spreading``, ``refgeo.codes``, ``refgeo.bounds``).
* Tokenwise decomposition of layer updates (``refgeo.tokenwise``).

The NumPy reference is the oracle; ``refgeo_ext`` (Cython) accelerates the hot loops
and CuPy arrays dispatch to GPU code.  See :func:`show_config`.
"""

from __future__ import annotations

from . import _backend
from ._backend import ExtensionUnavailableError, get_backend, use_backend
from ._config import __version__, show_config

# One module per idea; each defines a sorted ``__all__`` that is re-exported here.
from . import bounds, codes, hilbert, lmo, optim, rows, spreading, tokenwise
from .bounds import *  # noqa: F401,F403
from .codes import *  # noqa: F401,F403
from .hilbert import *  # noqa: F401,F403
from .lmo import *  # noqa: F401,F403
from .optim import *  # noqa: F401,F403
from .rows import *  # noqa: F401,F403
from .spreading import *  # noqa: F401,F403
from .tokenwise import *  # noqa: F401,F403

__all__ = sorted(
    ["ExtensionUnavailableError", "get_backend", "show_config", "use_backend", "__version__"]
    + bounds.__all__
    + codes.__all__
    + hilbert.__all__
    + lmo.__all__
    + optim.__all__
    + rows.__all__
    + spreading.__all__
    + tokenwise.__all__
)
