"""The first Ctrl-C ends a long command within about two seconds and keeps what it has done.

Python turns SIGINT into KeyboardInterrupt only when the main thread next runs Python code: inside one
long native call (a large matmul, the prefill of a long prompt) that can take minutes. Within
`stop_soon()` a watcher thread wakes on the signal itself (`signal.set_wakeup_fd`: the interpreter's C
handler writes the signal's number to a pipe at once) and, if the command has not ended `DEADLINE_S`
later, runs the functions registered with `keep` (which write what is done), says so and exits with
code 130, as an interrupted command does. While a command writes what it has (`saving()`: a checkpoint,
partial results) the deadline waits for it.

A command that stops on its own in time (KeyboardInterrupt reaching the CLI wrapper, or a training loop
ending after its step) never meets the watcher.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import sys
import threading
from typing import Callable, Optional

DEADLINE_S = 1.5
# After a save the deadline waited for, the command's own way out gets this long before the watcher's.
AFTER_SAVE_S = 0.5
EXIT_CODE = 130

_lock = threading.Lock()
_keepers: list[Callable[[], None]] = []
_saving = 0


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _run_keepers() -> None:
    with _lock:
        keepers = list(_keepers)
    for keeper in keepers:
        try:
            keeper()
        except Exception as err:  # noqa: BLE001 - the process is leaving: say it, run the others
            print(f"interrupted: could not keep partial output ({type(err).__name__}: {err})", file=sys.stderr)


def _saving_now() -> bool:
    with _lock:
        return _saving > 0


def _watch(read_fd: int, ended: threading.Event, deadline_s: float) -> None:
    """Wait for SIGINT's number on the wakeup pipe; then for the command to end, else stop the process."""
    try:
        while True:
            data = os.read(read_fd, 64)
            if not data:  # the pipe closed: the command ended
                return
            if signal.SIGINT not in data:
                continue
            if ended.wait(deadline_s):
                return
            waited = False
            while _saving_now() and not ended.is_set():
                waited = True
                ended.wait(0.05)
            if ended.is_set() or (waited and ended.wait(AFTER_SAVE_S)):
                return
            _run_keepers()
            print(f"\ninterrupted: stopped {deadline_s:.1f} s after Ctrl-C, in the middle of a long computation",
                  file=sys.stderr)
            _flush()
            os._exit(EXIT_CODE)
    finally:
        os.close(read_fd)


@contextlib.contextmanager
def stop_soon(deadline_s: float = DEADLINE_S):
    """Within the block, the first Ctrl-C ends the process within `deadline_s` (plus any save in progress,
    see `saving`), after the `keep` functions ran. Outside the main thread, a no-op (signals reach only it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter's thread after all
        os.close(read_fd)
        os.close(write_fd)
        yield
        return
    ended = threading.Event()
    watcher = threading.Thread(target=_watch, args=(read_fd, ended, deadline_s), name="natsl-stop-soon", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        ended.set()
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the watcher's read returns nothing: it ends and closes its end


@contextlib.contextmanager
def saving():
    """While inside, the deadline of `stop_soon` waits: what is being written is written whole."""
    global _saving
    with _lock:
        _saving += 1
    try:
        yield
    finally:
        with _lock:
            _saving -= 1


@contextlib.contextmanager
def keep(keeper: Callable[[], None]):
    """Within the block, `keeper()` runs (on the watcher's thread) before the deadline ends the process:
    it writes what is done from data that the main thread, stuck in native code, does not change."""
    with _lock:
        _keepers.append(keeper)
    try:
        yield
    finally:
        with _lock:
            _keepers.remove(keeper)


class Partial:
    """Results that grow piece by piece (a dict passed to `update` after each piece), written when the
    command is interrupted: on KeyboardInterrupt by the main thread (inside `saving`), or at the deadline
    by the watcher from the copy taken at the last update. The written result carries "interrupted": true.

    Args:
        write: writes a result (its JSON and PNG).
        each: called with the live result at every update (e.g. to save its JSON as it grows).
    """

    def __init__(self, write: Callable[[dict], None], each: Optional[Callable[[dict], None]] = None):
        self.write, self.each = write, each
        self.live: Optional[dict] = None
        self.snapshot: Optional[dict] = None

    def update(self, result: dict) -> None:
        self.live = result
        self.snapshot = copy.deepcopy(result)
        if self.each is not None:
            self.each(result)

    def _keep(self, result: Optional[dict]) -> None:
        if result is not None:
            self.write({**result, "interrupted": True})

    @contextlib.contextmanager
    def kept(self):
        """The block whose results are kept when the command is interrupted."""
        with keep(lambda: self._keep(self.snapshot)):
            try:
                yield self
            except KeyboardInterrupt:
                with saving():
                    self._keep(self.live)
                raise
