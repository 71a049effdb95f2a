import numpy as np
import numpy.typing as npt

from ._driver import ProgressHook

def knn64(XA: npt.NDArray[np.float64], nA: npt.NDArray[np.float64], SA: npt.NDArray[np.float64],
          XB: npt.NDArray[np.float64], nB: npt.NDArray[np.float64], SB: npt.NDArray[np.float64],
          symmetric: bool, exclude_self: bool, self_idx: npt.NDArray[np.int64], defer: bool,
          k: int, cl: float, eabs: float, tile: int,
          n_threads: int, K: int, heap_block: int,
          out_idx: npt.NDArray[np.int64], out_dist: npt.NDArray[np.float64],
          out_stats: npt.NDArray[np.int64],
          progress: ProgressHook = None) -> None: ...
def knn32(XA: npt.NDArray[np.float32], nA: npt.NDArray[np.float64], SA: npt.NDArray[np.float32],
          XB: npt.NDArray[np.float32], nB: npt.NDArray[np.float64], SB: npt.NDArray[np.float32],
          symmetric: bool, exclude_self: bool, self_idx: npt.NDArray[np.int64], defer: bool,
          k: int, cl: float, eabs: float, tile: int,
          n_threads: int, K: int, heap_block: int,
          out_idx: npt.NDArray[np.int64], out_dist: npt.NDArray[np.float64],
          out_stats: npt.NDArray[np.int64],
          progress: ProgressHook = None) -> None: ...
def knn32s64(XA: npt.NDArray[np.float32], nA: npt.NDArray[np.float64], SA: npt.NDArray[np.float64],
             XB: npt.NDArray[np.float32], nB: npt.NDArray[np.float64], SB: npt.NDArray[np.float64],
             symmetric: bool, exclude_self: bool, self_idx: npt.NDArray[np.int64], defer: bool,
             k: int, cl: float, eabs: float, tile: int,
             n_threads: int, K: int, heap_block: int,
             out_idx: npt.NDArray[np.int64], out_dist: npt.NDArray[np.float64],
             out_stats: npt.NDArray[np.int64],
             progress: ProgressHook = None) -> None: ...
def within64(XA: npt.NDArray[np.float64], nA: npt.NDArray[np.float64], XB: npt.NDArray[np.float64],
             nB: npt.NDArray[np.float64], T: npt.NDArray[np.float64], self_col: npt.NDArray[np.int64],
             cl: float, eabs: float, tile: int, n_threads: int,
             counts: npt.NDArray[np.int64], cols: npt.NDArray[np.int64],
             progress: ProgressHook = None) -> None: ...
def within32(XA: npt.NDArray[np.float32], nA: npt.NDArray[np.float64], XB: npt.NDArray[np.float32],
             nB: npt.NDArray[np.float64], T: npt.NDArray[np.float64], self_col: npt.NDArray[np.int64],
             cl: float, eabs: float, tile: int, n_threads: int,
             counts: npt.NDArray[np.int64], cols: npt.NDArray[np.int64],
             progress: ProgressHook = None) -> None: ...
def pick64(SA: npt.NDArray[np.float64], SB: npt.NDArray[np.float64], rows: npt.NDArray[np.int64],
           counts: npt.NDArray[np.int64], cols: npt.NDArray[np.int64], k: int, n_threads: int,
           out_idx: npt.NDArray[np.int64], out_dist: npt.NDArray[np.float64]) -> int: ...
def pick32(SA: npt.NDArray[np.float32], SB: npt.NDArray[np.float32], rows: npt.NDArray[np.int64],
           counts: npt.NDArray[np.int64], cols: npt.NDArray[np.int64], k: int, n_threads: int,
           out_idx: npt.NDArray[np.int64], out_dist: npt.NDArray[np.float64]) -> int: ...
