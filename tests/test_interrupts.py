"""The first Ctrl-C: a long command stops and keeps what it has done (natsl.interrupts). Each test sends
SIGINT once the process has printed its first progress, never after a wait; the timeouts only guard
against a hang."""

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from cli_checks import as_foreground

ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 600


def start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    full.pop("NATSL_FAULT", None)
    return subprocess.Popen([sys.executable, *as_foreground(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=full, cwd=ROOT)


def interrupt_when(proc: subprocess.Popen, stream: str, pattern: str) -> tuple[str, str, int]:
    """Read the process's `stream` until `pattern` appears, send SIGINT, and return (stdout, stderr, exit code)."""
    watched = getattr(proc, stream)
    seen = b""
    selector = selectors.DefaultSelector()
    selector.register(watched, selectors.EVENT_READ)
    give_up = time.monotonic() + HANG_GUARD_S
    while not re.search(pattern.encode(), seen):
        assert time.monotonic() < give_up, f"no {pattern!r} in {seen[-2000:]!r}"
        if selector.select(timeout=5):
            chunk = os.read(watched.fileno(), 65536)
            assert chunk, f"the process ended before {pattern!r}: {seen[-2000:]!r}"
            seen += chunk
    selector.close()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    if stream == "stdout":
        out = seen + out
    else:
        err = seen + err
    return out.decode(errors="replace"), err.decode(errors="replace"), proc.returncode


STUCK = """
import signal, sys, time
from natsl import interrupts

with interrupts.stop_soon():
    # Python's handler never raises here: the main thread stands for one stuck in a long native call
    signal.signal(signal.SIGINT, lambda *_: None)
    with interrupts.keep(lambda: open(sys.argv[1], "w").write("what was done")):
        print("working", flush=True)
        while True:
            time.sleep(0.05)
"""


def test_the_first_ctrl_c_ends_a_process_stuck_in_native_code_and_keeps_its_output(tmp_path):
    kept = tmp_path / "partial.txt"
    out, err, code = interrupt_when(start(["-c", STUCK, str(kept)]), "stdout", "working")
    assert code == 130, err
    assert kept.read_text() == "what was done"
    assert "interrupted: stopped" in err and "Traceback" not in err


def test_ctrl_c_stops_training_and_keeps_a_checkpoint(tmp_path, natsl_cache_dir):
    """The bar has shown step 2 or later, so step 1's checkpoint (save_every 1) is on disk; the run ends with
    exit code 130 after the step in progress (with its checkpoint) or at the deadline, keeping the newest."""
    from natsl.training.state import list_checkpoints, load_training_checkpoint

    out_dir = tmp_path / "run"
    args = ["-m", "natsl.cli.main", "train", str(ROOT / "recipes" / "tiny_hybrid.yaml"), "--set", "data.path=builtin",
            "train.seq_len=128", "train.micro_batch_size=4", "train.tokens_per_step=512", "train.save_every=1",
            "train.eval_every=100000", "train.keep_last=2", "--device", "cpu", "--backend", "chunked",
            "--out", str(out_dir)]
    out, err, code = interrupt_when(start(args, {"NATSL_CACHE_DIR": natsl_cache_dir}), "stderr",
                                    r"train: +\d+%\|[^|\r\n]*\| *([2-9]|\d\d+)/\d+ \[")
    assert code == 130, err
    assert "Traceback" not in err
    assert "SIGINT: stopped after step" in out + err or "SIGINT: step" in out + err, out + err
    checkpoints = list_checkpoints(out_dir)
    assert checkpoints, err
    load_training_checkpoint(checkpoints[-1][1])  # whole: manifest, weights, optimizer


def test_ctrl_c_stops_bench_latency_and_writes_the_points_it_has(tmp_path):
    out_dir = tmp_path / "bench"
    args = ["-m", "natsl.cli.main", "bench-latency", "--recipe", str(ROOT / "recipes" / "tiny_hybrid.yaml"),
            "--min-len", "64", "--max-len", "2048", "--repeats", "30", "--decode-tokens", "64", "--device", "cpu",
            "--out", str(out_dir)]
    out, err, code = interrupt_when(start(args), "stderr", r"bench-latency: +\d+%\|[^|\r\n]*\| *[1-9]\d*/\d+ \[")
    assert code == 130, err
    assert "Traceback" not in err
    result = json.loads((out_dir / "latency.json").read_text())
    measured = [p for p in result["models"][0]["points"] if "error" not in p]
    assert result["interrupted"] is True and measured, result
    assert (out_dir / "latency.png").stat().st_size > 0
    assert f"interrupted: wrote the {len(measured)} point(s) measured" in err
