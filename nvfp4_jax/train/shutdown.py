"""Clean shutdown: SIGTERM and SIGINT become a request that the training loop polls.

Cluster schedulers preempt with SIGTERM and give a grace period; Ctrl-C sends SIGINT. The first
of either only records the request (the loop then finishes its step, saves and exits); it also
restores the default action, so a second signal ends the process at once, even inside a long
compilation or save.
"""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """`with StopRequest() as stop: ... if stop.requested: ...`

    Handlers are installed only in the main thread (Python delivers signals there); elsewhere
    this object never fires. The previous handlers come back on exit.
    """

    def __init__(self, *, announce=None):
        self.signal_name: str | None = None
        self._announce = announce or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        self.signal_name = signal.Signals(signum).name
        self._announce(
            f"received {self.signal_name}: finishing the current step, saving a checkpoint and "
            "stopping (send it again to exit at once, without saving)."
        )

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()
