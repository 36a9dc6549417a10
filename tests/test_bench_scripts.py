"""The benchmark scripts' own plumbing (their measurements run on the GPU, not here)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0) until reaped: read its state where /proc exists.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_bench_training_ends_its_workers_when_it_is_terminated(tmp_path):
    """`timeout` around bench_training sends SIGTERM to the script only: its workers (and their
    own children, as under torchrun) must end with it instead of holding the GPU and the pipe."""
    pid_file = tmp_path / "pids"
    driver = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
        import bench_training
        worker = ("import os, subprocess, sys, time; "
                  "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                  "open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}'); time.sleep(120)")
        sys.exit(bench_training.run_child([sys.executable, "-c", worker]))
    """)
    script = subprocess.Popen([sys.executable, "-c", driver])
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and len(pid_file.read_text().split()) == 2):
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.1)
    pids = [int(p) for p in pid_file.read_text().split()]
    assert all(_alive(p) for p in pids)
    script.send_signal(signal.SIGTERM)
    assert script.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a worker outlived the terminated benchmark"
