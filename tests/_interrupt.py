"""Ctrl-C in a child process: start it, wait for its ready line, send SIGINT, time the exit.

A child started from a shell that ignores SIGINT (a background job, some CI runners)
would inherit the ignore, and Python would then install no KeyboardInterrupt handler;
the child therefore starts with the default disposition.
"""

from __future__ import annotations

import dataclasses
import selectors
import signal
import subprocess
import sys
import time

import pytest


@dataclasses.dataclass(frozen=True)
class Interrupted:
    """What a child printed after its ready line, its exit status, and the seconds
    from the SIGINT to its exit."""

    out: str
    err: str
    returncode: int
    seconds: float


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _read_line(stream, timeout: float) -> str | None:
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    try:
        return stream.readline() if sel.select(timeout) else None
    finally:
        sel.close()


def interrupt(code: str, *, ready: str = "ready", delay: float = 1.0, env=None, cwd=None,
              start_timeout: float = 300.0, exit_timeout: float = 30.0) -> Interrupted:
    """Run ``python -c code``; once it prints the line ``ready``, wait ``delay`` seconds
    (it must still be running then) and send SIGINT.  Fails the test if the child does
    not start, ends before the signal, or outlives ``exit_timeout`` after it."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=cwd, preexec_fn=_default_sigint)
    try:
        line = _read_line(proc.stdout, start_timeout)
        if line is None or line.strip() != ready:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the child did not print {ready!r} (got {line!r}):\n{err}")
        time.sleep(delay)
        if proc.poll() is not None:
            pytest.fail("the call ended before the signal: make the case larger")
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            out, err = proc.communicate(timeout=exit_timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {exit_timeout:g} s after SIGINT")
        return Interrupted(out, err, proc.returncode, time.monotonic() - t0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
