import numpy as np
import numpy.typing as npt

from ._driver import ProgressHook

def pdist_logits64(Z: npt.NDArray[np.float64], out: npt.NDArray[np.float64],
                   tile_rows: int, chunk: int, n_threads: int,
                   progress: ProgressHook = None) -> None: ...
def pdist_logits32(Z: npt.NDArray[np.float32], out: npt.NDArray[np.float64],
                   tile_rows: int, chunk: int, n_threads: int,
                   progress: ProgressHook = None) -> None: ...
def cdist_logits64(XA: npt.NDArray[np.float64], XB: npt.NDArray[np.float64],
                   out: npt.NDArray[np.float64], tile_rows: int, chunk: int,
                   n_threads: int,
                   progress: ProgressHook = None) -> None: ...
def cdist_logits32(XA: npt.NDArray[np.float32], XB: npt.NDArray[np.float32],
                   out: npt.NDArray[np.float64], tile_rows: int, chunk: int,
                   n_threads: int,
                   progress: ProgressHook = None) -> None: ...
