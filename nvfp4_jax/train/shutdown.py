"""Clean shutdown: SIGTERM and SIGINT become a request that the training loop polls.

Cluster schedulers preempt with SIGTERM and give a grace period; Ctrl-C sends SIGINT. The first
of either only records the request (the loop then finishes its step, saves and exits); a second
one ends the process at once, by that signal, even inside a long compilation or save.

Python runs a signal handler only between bytecodes of the main thread, so while that thread is
inside XLA (a compilation, a step) two signals in quick succession reach one handler call: the
second would be lost. Each signal is therefore also counted where it arrives: the C-level
handler writes its number to a wakeup pipe (`signal.set_wakeup_fd`), and a watcher thread reads
it, records the first and ends the process on the second.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _die_by(signum: int) -> None:
    """Ends the process by `signum`'s default action, from any thread (`signal.signal` may only
    be called from the main thread; the C library's may be called from any)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(ctypes.c_int(signum), ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signum)
    finally:
        os._exit(128 + signum)  # what a shell reports for a death by signum, if it did not happen


class StopRequest:
    """`with StopRequest() as stop: ... if stop.requested: ...`

    Handlers are installed only in the main thread (Python delivers signals there); elsewhere
    this object never fires. The previous handlers come back on exit.
    """

    def __init__(self, *, announce=None):
        self.signal_name: str | None = None
        self._announce = announce or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._previous: dict[int, object] = {}
        self._lock = threading.Lock()
        self._count = 0
        self._pipe: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._watcher: threading.Thread | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _record(self, signum: int) -> None:
        with self._lock:
            if self.signal_name is not None:
                return
            self.signal_name = signal.Signals(signum).name
        self._announce(
            f"received {self.signal_name}: finishing the current step, saving a checkpoint and "
            "stopping (send it again to exit at once, without saving)."
        )

    def _handle(self, signum, frame) -> None:
        # From now on the default action ends the process; the watcher has counted this one.
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        self._record(signum)

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return  # the pipe was closed on exit
            for signum in data:
                if signum not in SIGNALS:
                    continue
                self._count += 1
                if self._count >= 2:
                    _die_by(signum)
                self._record(signum)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)  # set_wakeup_fd requires it
            self._pipe = (read_fd, write_fd)
            self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            self._watcher = threading.Thread(target=self._watch, args=(read_fd,), daemon=True,
                                             name="nvfp4_jax-signal-watcher")
            self._watcher.start()
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            read_fd, write_fd = self._pipe
            os.close(write_fd)  # the watcher reads end-of-file and returns
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            with contextlib.suppress(OSError):
                os.close(read_fd)
            self._pipe = None
