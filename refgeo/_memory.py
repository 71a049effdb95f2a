"""How much memory a call may still take, and the check public functions make before work.

A function that would allocate more than the machine can give refuses at once, with
what it needs, what is available and what to change (:func:`check_memory`), instead of
failing after minutes or being killed by the kernel.  This module depends on nothing
else in refgeo, so every layer may use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["available_memory", "check_memory", "format_bytes"]


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under a cgroup v2 memory limit, or None without a limit.

    ``memory.max - memory.current``, where the usage leaves out the cgroup's inactive
    file cache (``inactive_file`` in ``memory.stat``): the kernel reclaims those pages
    before it fails an allocation, and a memory-mapped input that was read once
    would otherwise count as used.
    """
    limit = _read_int(os.path.join(root, "memory.max"))
    used = _read_int(os.path.join(root, "memory.current"))
    if limit is None or used is None:
        return None
    try:
        with open(os.path.join(root, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "inactive_file" and value.strip().isdigit():
                    used -= min(int(value), used)
                    break
    except OSError:
        pass
    return max(limit - used, 0)


def available_memory() -> int | None:
    """Bytes this process can still allocate, or None when unknown.

    The smaller of the system's available memory (``MemAvailable`` in
    ``/proc/meminfo``, or ``sysconf`` available pages elsewhere) and the room left
    under a cgroup v2 memory limit (``memory.max`` minus the usage without the
    reclaimable inactive file cache), so that a container's limit counts, not the
    host's memory.
    """
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):
            pass
    room = _cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def format_bytes(n: float) -> str:
    """``n`` bytes as a short human-readable string (binary units), e.g. ``'1.5 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def check_memory(what: str, parts: Mapping[str, float], advice: str, *, room: int | None = None,
                 where: str = "") -> None:
    """Raise ``MemoryError`` when the bytes in ``parts`` exceed :func:`available_memory`.

    Parameters
    ----------
    what : str
        The call, e.g. ``"decompose(N=50000, d=768, k=64)"``.
    parts : mapping of str to float
        Bytes per named allocation, e.g. ``{"output (8 arrays of (N, d) float64)": 2.4e9}``.
    advice : str
        What to change so that the call fits.
    room : int, optional
        The bytes to compare with instead of this process's available memory (e.g. a
        Dask worker's memory limit).
    where : str, default=""
        Appended to "are available" in the message: whose the bytes are
        (``" on the Dask workers together"``).

    Nothing is checked when the available memory is unknown.
    """
    need = float(sum(parts.values()))
    avail = available_memory() if room is None else room
    if avail is None or need <= avail:
        return
    detail = "; ".join(f"{name}: {format_bytes(b)}" for name, b in parts.items() if b > 0)
    raise MemoryError(
        f"{what} needs about {format_bytes(need)} ({detail}), but only {format_bytes(avail)} "
        f"are available{where}. {advice}"
    )
