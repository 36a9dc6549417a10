"""Fault injection for the crash tests: the environment variable NATSL_FAULT kills the process on purpose.

`NATSL_FAULT="kill_after_step:5"` sends SIGKILL to the trainer right after step 5 is applied;
`kill_in_checkpoint:4` does so while the step-4 checkpoint is half written (optimizer state
on disk in the temporary folder, model files not yet); `kill_after_commit:1` stops `natsl
tokenize` after its first committed chunk. Several points are separated by commas. Without the
variable every point is a no-op; it exists so that the tests can prove that a killed run resumes.
"""

from __future__ import annotations

import os
import signal


def _points() -> dict[str, str]:
    spec = os.environ.get("NATSL_FAULT", "")
    out = {}
    for item in spec.split(","):
        if ":" in item:
            name, value = item.split(":", 1)
            out[name.strip()] = value.strip()
    return out


def fault_point(name: str, value) -> None:
    """SIGKILL this process if NATSL_FAULT names `name` with `value` (no cleanup, like a crash)."""
    if not os.environ.get("NATSL_FAULT"):
        return
    if _points().get(name) == str(value):
        os.kill(os.getpid(), signal.SIGKILL)
