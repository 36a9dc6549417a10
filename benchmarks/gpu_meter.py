"""The GPU's energy, power and SM clock over a stretch of work, sampled through NVML (nvidia-ml-py).

    with GpuMeter.for_device(torch.device("cuda", 0)) as meter:
        ... work ...; marks.append(time.perf_counter())
    meter.window(t0, t1)   # {"energy_j", "power_w_mean", "sm_clock_mhz_median", ...} or None

Why: the H200 runs a compiled 800M training step at its ~690 W power limit (docs/benchmarks.md,
nineteenth session), where its SM clock drops below boost and a step costs its energy. Joules per step
say what a change saves there; time alone mixes the work with the clock the power limit leaves.

A thread reads the board's cumulative energy counter (mJ), its power draw and the SM clock every
`interval_s` (host clock: time.perf_counter); `window` interpolates the counter linearly at the two ends.
Where NVML is missing (no nvidia-ml-py, no driver, the CPU) the meter is unavailable and `window`
returns None: benchmarks then simply leave the fields out.
"""

from __future__ import annotations

import statistics
import threading
import time
from bisect import bisect_left
from typing import Optional


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
    def __init__(self, handle=None, nvml=None, interval_s: float = 0.05, reason: str = ""):
        self.handle, self.nvml, self.interval_s = handle, nvml, interval_s
        self.reason = reason  # why there is no meter (printed by the benchmarks), "" where there is one
        # (time, energy mJ, power W, SM clock MHz)
        self.samples: list[tuple[float, float, float, float]] = []
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
