import numpy as np
import numpy.typing as npt

def block_pair_keys64(XA: npt.NDArray[np.float64], nA: npt.NDArray[np.float64],
                      XB: npt.NDArray[np.float64], nB: npt.NDArray[np.float64], same: bool,
                      exclude_self: bool, both: bool, tile: int,
                      keysA: npt.NDArray[np.float64], idsA: npt.NDArray[np.int64],
                      keysB: npt.NDArray[np.float64], idsB: npt.NDArray[np.int64]) -> None: ...
def block_pair_keys32(XA: npt.NDArray[np.float32], nA: npt.NDArray[np.float64],
                      XB: npt.NDArray[np.float32], nB: npt.NDArray[np.float64], same: bool,
                      exclude_self: bool, both: bool, tile: int,
                      keysA: npt.NDArray[np.float64], idsA: npt.NDArray[np.int64],
                      keysB: npt.NDArray[np.float64], idsB: npt.NDArray[np.int64]) -> None: ...
def block_pair_records64(XA: npt.NDArray[np.float64], XB: npt.NDArray[np.float64],
                         norms: npt.NDArray[np.float64], tile: int,
                         records: npt.NDArray[np.float64]) -> None: ...
def block_pair_records32(XA: npt.NDArray[np.float32], XB: npt.NDArray[np.float32],
                         norms: npt.NDArray[np.float64], tile: int,
                         records: npt.NDArray[np.float64]) -> None: ...
def refine_pairs64(A: npt.NDArray[np.float64], B: npt.NDArray[np.float64],
                   rows: npt.NDArray[np.int64], cols: npt.NDArray[np.int64],
                   out: npt.NDArray[np.float64]) -> None: ...
def refine_pairs32(A: npt.NDArray[np.float32], B: npt.NDArray[np.float32],
                   rows: npt.NDArray[np.int64], cols: npt.NDArray[np.int64],
                   out: npt.NDArray[np.float64]) -> None: ...
def block_pair_extreme64(XA: npt.NDArray[np.float64], nA: npt.NDArray[np.float64], SA: npt.NDArray[np.float64],
                         XB: npt.NDArray[np.float64], nB: npt.NDArray[np.float64], SB: npt.NDArray[np.float64],
                         same: bool, maximize: bool, cp: float, eabs: float,
                         tile: int, bound0: float = ..., budget: int = ...) -> tuple[float, int, int, int, bool]: ...
def block_pair_extreme32(XA: npt.NDArray[np.float32], nA: npt.NDArray[np.float64], SA: npt.NDArray[np.float32],
                         XB: npt.NDArray[np.float32], nB: npt.NDArray[np.float64], SB: npt.NDArray[np.float32],
                         same: bool, maximize: bool, cp: float, eabs: float,
                         tile: int, bound0: float = ..., budget: int = ...) -> tuple[float, int, int, int, bool]: ...
def block_pair_extreme32s64(XA: npt.NDArray[np.float32], nA: npt.NDArray[np.float64], SA: npt.NDArray[np.float64],
                            XB: npt.NDArray[np.float32], nB: npt.NDArray[np.float64], SB: npt.NDArray[np.float64],
                            same: bool, maximize: bool, cp: float, eabs: float,
                            tile: int, bound0: float = ..., budget: int = ...) -> tuple[float, int, int, int, bool]: ...
def block_pair_farthest64(XA: npt.NDArray[np.float64], nA: npt.NDArray[np.float64], SA: npt.NDArray[np.float64],
                          XB: npt.NDArray[np.float64], nB: npt.NDArray[np.float64], SB: npt.NDArray[np.float64],
                          same: bool, cp: float, eabs: float, tile: int,
                          valA: npt.NDArray[np.float64], idA: npt.NDArray[np.int64],
                          valB: npt.NDArray[np.float64], idB: npt.NDArray[np.int64],
                          lowA: npt.NDArray[np.float64] | None = ..., lowB: npt.NDArray[np.float64] | None = ...,
                          cap: int = ..., budget: int = ..., heavy_rows: int = ...) -> tuple[int, bool]: ...
def block_pair_farthest32(XA: npt.NDArray[np.float32], nA: npt.NDArray[np.float64], SA: npt.NDArray[np.float32],
                          XB: npt.NDArray[np.float32], nB: npt.NDArray[np.float64], SB: npt.NDArray[np.float32],
                          same: bool, cp: float, eabs: float, tile: int,
                          valA: npt.NDArray[np.float64], idA: npt.NDArray[np.int64],
                          valB: npt.NDArray[np.float64], idB: npt.NDArray[np.int64],
                          lowA: npt.NDArray[np.float64] | None = ..., lowB: npt.NDArray[np.float64] | None = ...,
                          cap: int = ..., budget: int = ..., heavy_rows: int = ...) -> tuple[int, bool]: ...
def block_pair_farthest32s64(XA: npt.NDArray[np.float32], nA: npt.NDArray[np.float64], SA: npt.NDArray[np.float64],
                          XB: npt.NDArray[np.float32], nB: npt.NDArray[np.float64], SB: npt.NDArray[np.float64],
                          same: bool, cp: float, eabs: float, tile: int,
                          valA: npt.NDArray[np.float64], idA: npt.NDArray[np.int64],
                          valB: npt.NDArray[np.float64], idB: npt.NDArray[np.int64],
                             lowA: npt.NDArray[np.float64] | None = ..., lowB: npt.NDArray[np.float64] | None = ...,
                             cap: int = ..., budget: int = ..., heavy_rows: int = ...) -> tuple[int, bool]: ...
