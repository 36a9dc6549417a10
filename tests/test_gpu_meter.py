"""benchmarks.common.GpuMeter: energy over a window from NVML's cumulative counter, here against a fake NVML
whose board draws a known constant power (the real one needs a GPU and nvidia-ml-py)."""

import sys
import time

import pytest
import torch

from benchmarks import training
from benchmarks.common import GpuMeter, interpolate


class ConstantBoard:
    """NVML's calls for one board that draws `watts` from the first read on, at a fixed SM clock."""
    NVML_CLOCK_SM = 1

    def __init__(self, watts: float, mhz: int):
        self.watts, self.mhz, self.t0 = watts, mhz, time.perf_counter()

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):  # mJ, as NVML counts them (an integer)
        return int(1000 * self.watts * (time.perf_counter() - self.t0)) + 5_000_000

    def nvmlDeviceGetPowerUsage(self, handle):  # mW
        return int(1000 * self.watts)

    def nvmlDeviceGetClockInfo(self, handle, which):
        assert which == self.NVML_CLOCK_SM
        return self.mhz


def test_interpolate_is_linear_between_samples_and_none_outside():
    samples = [(0.0, 10.0), (1.0, 20.0), (3.0, 60.0)]
    assert interpolate(samples, 0.5) == pytest.approx(15.0)
    assert interpolate(samples, 2.0) == pytest.approx(40.0)
    assert interpolate(samples, 1.0) == 20.0
    assert interpolate(samples, -0.1) is None and interpolate(samples, 3.5) is None and interpolate([], 1.0) is None


def stretch(seconds: float) -> tuple[float, float]:
    """(start, end) host times of a stretch of `seconds`, begun a little after the meter's first sample."""
    time.sleep(0.05)
    t0 = time.perf_counter()
    time.sleep(seconds)
    return t0, time.perf_counter()


def test_window_gives_the_energy_power_and_clock_of_a_stretch():
    board = ConstantBoard(watts=690.0, mhz=1700)
    with GpuMeter(handle=object(), nvml=board, interval_s=0.01) as meter:
        t0, t1 = stretch(0.3)
        time.sleep(0.05)
    window = meter.window(t0, t1)
    assert window["energy_j"] == pytest.approx(690.0 * (t1 - t0), rel=0.02)
    assert window["power_w_mean"] == pytest.approx(690.0, rel=0.02)
    assert window["sm_clock_mhz_median"] == 1700 and window["samples"] >= 5
    assert meter.window(t0 - 10, t1) is None  # before the first sample: no guess


def test_a_window_asked_while_metering_waits_for_a_sample_past_its_end():
    """layer.py --energy asks right after the work, inside the meter: the newest sample is then older than
    the window's end, and the answer must wait for the next one instead of giving up."""
    board = ConstantBoard(watts=500.0, mhz=1800)
    with GpuMeter(handle=object(), nvml=board, interval_s=0.2) as meter:
        t0, t1 = stretch(0.5)
        assert meter.samples[-1][0] < t1
        window = meter.window(t0, t1)
    assert window is not None and window["energy_j"] == pytest.approx(500.0 * (t1 - t0), rel=0.05)


def test_no_meter_off_cuda_and_the_fields_are_left_out():
    meter = GpuMeter.for_device(torch.device("cpu"))
    assert not meter.available and meter.reason == "not a CUDA device"
    with meter:
        pass
    assert meter.window(0.0, 1.0) is None


def test_training_reports_the_timed_steps_energy(tmp_path, monkeypatch, natsl_cache_dir):
    """benchmarks.training's worker with a meter on a fake 690 W board (on the CPU): the timed steps' joules per
    step are the board's power times their mean step time, and tokens per joule follow from them."""
    import json

    monkeypatch.setenv("NATSL_CACHE_DIR", natsl_cache_dir)  # the run's shared corpus cache
    board = ConstantBoard(watts=690.0, mhz=1700)
    monkeypatch.setattr(training.GpuMeter, "for_device",
                        classmethod(lambda cls, device, interval_s=0.05: cls(object(), board, 0.005)))
    result = tmp_path / "result.json"
    args = training.build_parser().parse_args([
        "--worker", "tiny_hybrid", "--result", str(result), "--micro-batch-size", "2", "--seq-len", "64",
        "--max-steps", "4", "--warmup-steps", "1", "--device", "cpu", "--backend", "chunked"])
    training.worker(args)
    r = json.loads(result.read_text())
    assert r["status"] == "ok" and r["steps_timed"] == 3
    # the window runs from the end of the warm-up step to the end of the last one: the timed steps' own time
    assert r["energy_j_per_step"] == pytest.approx(690.0 * r["step_ms"] / 1000, rel=0.1)
    assert r["tokens_per_joule"] == pytest.approx(r["tokens_per_step"] / r["energy_j_per_step"], rel=1e-6)
    assert r["power_w_mean"] == pytest.approx(690.0, rel=0.1) and r["sm_clock_mhz_median"] == 1700


def test_the_meter_finds_the_cuda_device_by_pci_bus_id_or_else_by_index(monkeypatch):
    """GpuMeter.for_device on a CUDA device, with NVML and the device's properties faked: the board is looked
    up by the PCI bus id NVML spells (upper-case hex), and by index where that lookup fails."""
    import types

    calls = []

    class FakeNvml(ConstantBoard):
        def __init__(self, bus_ok):
            super().__init__(watts=500.0, mhz=1500)
            self.bus_ok = bus_ok

        def nvmlInit(self):
            calls.append("init")

        def nvmlDeviceGetHandleByPciBusId(self, bus_id):
            calls.append(bus_id)
            if not self.bus_ok:
                raise RuntimeError("NVML_ERROR_NOT_FOUND")
            return "by-bus"

        def nvmlDeviceGetHandleByIndex(self, index):
            calls.append(index)
            return "by-index"

    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    for bus_ok, handle in ((True, "by-bus"), (False, "by-index")):
        calls.clear()
        monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(bus_ok))
        meter = GpuMeter.for_device(torch.device("cuda", 1))
        assert meter.available and meter.handle == handle
        assert calls[:2] == ["init", "00000000:3B:00.0"] and calls[2:] == ([] if bus_ok else [1])
