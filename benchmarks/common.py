"""What every benchmark entry shares: timing, the results folder, JSON + PNG writers, the GPU energy meter.

Timing: `time_ms` is the median of `triton.testing.do_bench` on CUDA (CUDA events, L2 flushed between
calls) and of host-clock calls elsewhere (so that every entry also runs, slowly, on a CPU);
`graph_ms` replays calls captured in a CUDA graph (decode-sized work, no launch overhead).
Results: `write_result(name, payload, out)` writes `OUT/name.json` atomically with `provenance()`;
`bar_png` draws a side-by-side bar chart beside it. `bench_results/` is git-ignored; `--out` moves it.

`GpuMeter` samples the board's cumulative energy counter, power and SM clock through NVML
(nvidia-ml-py, the `bench` extra) on a thread; `window(t0, t1)` gives the joules, mean power and clock
between two host times, or None without NVML (then the entries leave those fields out). The H200
trains at its power limit, where a step's joules say what a change saves better than its time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from bisect import bisect_left
from pathlib import Path
from typing import Callable, Optional

RESULTS = "bench_results"
# --shapes names of the recipes whose widths the op and layer entries take
PRESETS = {"800m": "800m_hybrid", "380m": "380m_hybrid", "tiny": "tiny_hybrid"}


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.environ.get("OUT") or RESULTS,
                        help=f"folder for the JSON and PNG results (default: $OUT, else {RESULTS}/)")


def time_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100, grad_to_none=None,
            cuda: Optional[bool] = None) -> float:
    """Median milliseconds of one call of `fn`: do_bench when `cuda` (default: a CUDA device is there),
    else the host clock over a few calls."""
    import torch

    if torch.cuda.is_available() if cuda is None else cuda:
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    fn()  # warm-up: first-call compilation and allocation
    times = []
    for _ in range(3):
        for leaf in grad_to_none or ():
            leaf.grad = None
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def graph_ms(fn: Callable[[], object], *, calls: int = 50, replays: int = 20) -> float:
    """Median milliseconds per call of `calls` calls captured in one CUDA graph and replayed `replays`
    times (as a decode step runs: no host time). Off CUDA: time_ms."""
    import torch

    if not torch.cuda.is_available():
        return time_ms(fn, cuda=False)
    from natsl.inference.cuda_graph import capture

    graph, _ = capture(fn, warmups=3, calls=calls)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def rel_rms(a, b) -> float:
    """Relative RMS difference of a against b (in float64)."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def write_result(name: str, payload: dict, out: str | Path) -> Path:
    """OUT/name.json holding `payload` and the provenance of the code that produced it."""
    from natsl.provenance import provenance

    data = {"benchmark": name, "provenance": provenance(), **payload}

    from natsl.atomic import write_text

    return write_text(Path(out) / f"{name}.json", json.dumps(data, indent=1, default=str))


def bar_png(path: str | Path, groups: dict[str, dict[str, float]], ylabel: str, title: str) -> Optional[Path]:
    """Grouped bars: one group per key of `groups` (e.g. a shape), one bar per series inside it (e.g. a
    provider). Nothing is written when there is nothing to draw."""
    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(series)) ** 0.5), 4.2), dpi=100)
    for i, name in enumerate(series):
        xs = [g + i * width for g, values in enumerate(groups.values()) if name in values]
        ax.bar(xs, [values[name] for values in groups.values() if name in values], width, label=name)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels(list(groups), rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    from natsl.atomic import save_figure

    return save_figure(fig, path)


def table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of `columns` (floats to 4 significant digits; missing cells as '-')."""
    def cell(v):
        if v is None:
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def interpolate(samples: list[tuple[float, float]], t: float) -> Optional[float]:
    """The value at time t of (time, value) samples sorted by time, linear between neighbours; None
    outside the sampled span."""
    if not samples or t < samples[0][0] or t > samples[-1][0]:
        return None
    i = bisect_left([s[0] for s in samples], t)
    if samples[i][0] == t:
        return samples[i][1]
    (t0, v0), (t1, v1) = samples[i - 1], samples[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


class GpuMeter:
    """Energy, power and SM clock of one GPU sampled through NVML (see the module's docstring)."""

    def __init__(self, handle=None, nvml=None, interval_s: float = 0.05, reason: str = ""):
        self.handle, self.nvml, self.interval_s = handle, nvml, interval_s
        self.reason = reason  # why there is no meter (printed by the benchmarks), "" where there is one
        self.samples: list[tuple[float, float, float, float]] = []  # (time, energy mJ, power W, SM clock MHz)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def for_device(cls, device, interval_s: float = 0.05) -> "GpuMeter":
        """A meter on the NVML device that is this CUDA device (matched by PCI bus id), or an unavailable
        one (off CUDA, or without nvidia-ml-py / the driver's NVML)."""
        if getattr(device, "type", "cpu") != "cuda":
            return cls(reason="not a CUDA device")
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(device)
            try:  # NVML spells bus ids in upper-case hex, e.g. 00000000:3B:00.0
                bus_id = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            except Exception:  # noqa: BLE001 - an older torch, or no match: NVML's order is CUDA's where
                # CUDA_VISIBLE_DEVICES does not reorder
                handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # refuses on boards without the counter
        except Exception as error:  # noqa: BLE001 - any failure means "no meter", never a failed benchmark
            return cls(reason=f"{type(error).__name__}: {error}")
        return cls(handle, pynvml, interval_s)

    @property
    def available(self) -> bool:
        return self.handle is not None

    def _read(self) -> tuple[float, float, float, float]:
        n = self.nvml
        return (time.perf_counter(), float(n.nvmlDeviceGetTotalEnergyConsumption(self.handle)),
                n.nvmlDeviceGetPowerUsage(self.handle) / 1000.0,
                float(n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._read())
            self._stop.wait(self.interval_s)
        self.samples.append(self._read())

    def __enter__(self) -> "GpuMeter":
        if self.available:
            self._thread = threading.Thread(target=self._run, name="gpu-meter", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def window(self, t0: float, t1: float) -> Optional[dict]:
        """Energy (J), mean power (W) and the SM clock's median, min and max (MHz) between host times
        t0 < t1, or None without a meter or samples spanning the window."""
        if not self.available:
            return None
        # Asked while the meter runs, right after the work: wait for a sample past t1 to interpolate against
        deadline = time.perf_counter() + 10 * self.interval_s + 1.0
        while (self._thread is not None and self._thread.is_alive() and time.perf_counter() < deadline
               and (not self.samples or self.samples[-1][0] < t1)):
            time.sleep(self.interval_s / 4)
        energy = [(s[0], s[1]) for s in self.samples]
        e0, e1 = interpolate(energy, t0), interpolate(energy, t1)
        if e0 is None or e1 is None or t1 <= t0:
            return None
        inside = [s for s in self.samples if t0 <= s[0] <= t1] or [min(self.samples, key=lambda s: abs(s[0] - t0))]
        clocks = [s[3] for s in inside]
        energy_j = (e1 - e0) / 1000.0
        return {"energy_j": energy_j, "power_w_mean": energy_j / (t1 - t0),
                "power_w_max_sampled": max(s[2] for s in inside), "sm_clock_mhz_median": statistics.median(clocks),
                "sm_clock_mhz_min": min(clocks), "sm_clock_mhz_max": max(clocks), "samples": len(inside)}
