"""A site's energy for a round: read from the platform's energy counter where it exposes one, else
the stated model `watts x busy seconds`, and always said which.

Counters (cumulative, read before and after the round's training):
- `nvml`: NVIDIA GPUs, NVML's total-energy counter (millijoules since the driver loaded; Volta and
  later), summed over the site's GPUs. Needs the `pynvml` module (`pip install nvidia-ml-py`); a
  GPU without the counter, or no NVML, falls through.
- `rapl`: Linux RAPL, `/sys/class/powercap/intel-rapl:N/energy_uj` (microjoules) of every CPU
  package, with the counter's wrap (`max_energy_range_uj`) undone. Readable only where the kernel
  allows (often root only); an unreadable counter falls through.
- `model`: `watts x busy seconds` with the site's stated `--watts` (an experiment's emulated power).
No counter and no `--watts`: the site reports no energy (the budget then ignores energy).
A counter measures the whole device or package (other processes included), not this job alone.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Callable, Sequence

RAPL_ROOT = "/sys/class/powercap"


@dataclasses.dataclass(frozen=True)
class Counter:
    """One cumulative energy counter: `read()` gives joules since some fixed origin; `wrap`
    (joules) is where it starts again from 0 (None: it does not wrap)."""

    read: Callable[[], float]
    wrap: float | None = None

    def joules_between(self, before: float, after: float) -> float:
        """The energy used between two readings (at most one wrap in between)."""
        if after < before and self.wrap:
            return after + self.wrap - before
        return after - before


@dataclasses.dataclass(frozen=True)
class Meter:
    """A site's counters (one per GPU or CPU package), read together; each wraps on its own."""

    source: str  # "nvml" | "rapl"
    counters: tuple[Counter, ...]

    def read(self) -> tuple[float, ...]:
        return tuple(c.read() for c in self.counters)

    def joules_between(self, before: Sequence[float], after: Sequence[float]) -> float:
        return sum(c.joules_between(b, a) for c, b, a in zip(self.counters, before, after, strict=True))


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def rapl_meter(root: str = RAPL_ROOT) -> Meter | None:
    """Every CPU package's RAPL counter under `root` (`intel-rapl:N`, not its sub-domains such as
    `intel-rapl:N:M`, which the package's count includes), or None where none is readable."""
    counters = []
    for d in sorted(glob.glob(os.path.join(root, "intel-rapl:*"))):
        if os.path.basename(d).count(":") != 1:
            continue
        energy = os.path.join(d, "energy_uj")
        try:
            _read_int(energy)
            wrap_uj = _read_int(os.path.join(d, "max_energy_range_uj"))
        except (OSError, ValueError):
            continue  # not readable here (permissions), or not a counter
        counters.append(Counter(lambda path=energy: _read_int(path) * 1e-6, wrap_uj * 1e-6))
    return Meter("rapl", tuple(counters)) if counters else None


def nvml_meter(device_indices: Sequence[int], nvml=None) -> Meter | None:
    """NVML's total-energy counter summed over `device_indices`, or None without NVML or without
    the counter on one of them. `nvml`: the `pynvml` module (imported when None)."""
    if not device_indices:
        return None
    try:
        if nvml is None:
            import pynvml as nvml  # optional dependency (nvidia-ml-py)
        nvml.nvmlInit()
        handles = [nvml.nvmlDeviceGetHandleByIndex(int(i)) for i in device_indices]
        for h in handles:
            nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    except Exception:  # no module, no driver, or a GPU without the counter: NVML's own errors
        return None
    # NVML's counter is a 64-bit count of millijoules: it does not wrap in practice.
    return Meter("nvml", tuple(Counter(lambda h=h: nvml.nvmlDeviceGetTotalEnergyConsumption(h) * 1e-3)
                               for h in handles))


def site_meter(platform: str, gpu_indices: Sequence[int] = (), *, rapl_root: str = RAPL_ROOT,
               nvml=None) -> Meter | None:
    """The counter a site on `platform` ("gpu" or "cpu") reads, or None where there is none."""
    if platform == "gpu":
        return nvml_meter(gpu_indices, nvml)
    return rapl_meter(rapl_root)


class RoundEnergy:
    """Measures one round: `start()` before the training, `joules(seconds)` after it, which
    returns `(joules or None, source or None)`: the counter's difference, else the stated model."""

    def __init__(self, meter: Meter | None, watts: float | None):
        self.meter, self.watts = meter, watts
        self._before = None

    def start(self) -> None:
        self._before = self.meter.read() if self.meter is not None else None

    def joules(self, busy_seconds: float) -> tuple[float | None, str | None]:
        if self.meter is not None and self._before is not None:
            return self.meter.joules_between(self._before, self.meter.read()), self.meter.source
        if self.watts is not None:
            return self.watts * busy_seconds, "model"
        return None, None
