import numpy as np
import numpy.typing as npt

from ._driver import ProgressHook

def extreme_pair64(X: npt.NDArray[np.float64], nrm: npt.NDArray[np.float64],
                   tile_rmax: npt.NDArray[np.float64], S: npt.NDArray[np.float64],
                   maximize: bool, cp: float, eabs: float, bound0: float, tile: int,
                   n_threads: int, out_r: npt.NDArray[np.float64],
                   out_ij: npt.NDArray[np.int64], out_nref: npt.NDArray[np.int64],
                   progress: ProgressHook = None, budget: int = 0) -> bool: ...
def extreme_pair32(X: npt.NDArray[np.float32], nrm: npt.NDArray[np.float64],
                   tile_rmax: npt.NDArray[np.float64], S: npt.NDArray[np.float32],
                   maximize: bool, cp: float, eabs: float, bound0: float, tile: int,
                   n_threads: int, out_r: npt.NDArray[np.float64],
                   out_ij: npt.NDArray[np.int64], out_nref: npt.NDArray[np.int64],
                   progress: ProgressHook = None, budget: int = 0) -> bool: ...
def farthest_partners64(X: npt.NDArray[np.float64], nrm: npt.NDArray[np.float64],
                        S: npt.NDArray[np.float64], cp: float, eabs: float, tile: int,
                        n_threads: int, L: npt.NDArray[np.float64], B: npt.NDArray[np.float64],
                        Bj: npt.NDArray[np.int64], out_nref: npt.NDArray[np.int64],
                        progress: ProgressHook = None, cap: int = 0,
                        budget: int = 0, heavy_rows: int = 0) -> bool: ...
def farthest_partners32(X: npt.NDArray[np.float32], nrm: npt.NDArray[np.float64],
                        S: npt.NDArray[np.float32], cp: float, eabs: float, tile: int,
                        n_threads: int, L: npt.NDArray[np.float64], B: npt.NDArray[np.float64],
                        Bj: npt.NDArray[np.int64], out_nref: npt.NDArray[np.int64],
                        progress: ProgressHook = None, cap: int = 0,
                        budget: int = 0, heavy_rows: int = 0) -> bool: ...
def extreme_pair32s64(X: npt.NDArray[np.float32], nrm: npt.NDArray[np.float64],
                      tile_rmax: npt.NDArray[np.float64], S: npt.NDArray[np.float64],
                      maximize: bool, cp: float, eabs: float, bound0: float, tile: int,
                      n_threads: int, out_r: npt.NDArray[np.float64],
                      out_ij: npt.NDArray[np.int64], out_nref: npt.NDArray[np.int64],
                      progress: ProgressHook = None, budget: int = 0) -> bool: ...
def farthest_partners32s64(X: npt.NDArray[np.float32], nrm: npt.NDArray[np.float64],
                           S: npt.NDArray[np.float64], cp: float, eabs: float, tile: int,
                           n_threads: int, L: npt.NDArray[np.float64], B: npt.NDArray[np.float64],
                           Bj: npt.NDArray[np.int64], out_nref: npt.NDArray[np.int64],
                           progress: ProgressHook = None, cap: int = 0,
                           budget: int = 0, heavy_rows: int = 0) -> bool: ...
