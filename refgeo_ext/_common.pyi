import numpy as np
import numpy.typing as npt

def center64(S: npt.NDArray[np.float64], mu: npt.NDArray[np.float64],
             X: npt.NDArray[np.float64], nrm: npt.NDArray[np.float64], n_threads: int) -> None: ...
def center32(S: npt.NDArray[np.float32], mu: npt.NDArray[np.float64],
             X: npt.NDArray[np.float32], nrm: npt.NDArray[np.float64], n_threads: int) -> None: ...
def center32s64(S: npt.NDArray[np.float64], mu: npt.NDArray[np.float64],
                X: npt.NDArray[np.float32], nrm: npt.NDArray[np.float64], n_threads: int) -> None: ...
def has_openmp() -> bool: ...
def openmp_max_threads() -> int:
    """OpenMP's maximum thread count; 1 without OpenMP or in a forked child (warns once)."""
def in_forked_child() -> bool:
    """True in a process forked after refgeo_ext was loaded (kernels run serially)."""
