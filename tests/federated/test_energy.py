"""A site's energy: a platform counter where one is readable (RAPL, NVML), its wrap undone,
else the stated model; every figure says which."""

import pytest

from nvfp4_jax.federated import energy as E


def _package(root, name, uj, wrap_uj=1_000_000):
    d = root / name
    d.mkdir()
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{wrap_uj}\n")
    return d


def test_rapl_sums_the_packages_not_their_subdomains_and_undoes_each_wrap(tmp_path):
    p0 = _package(tmp_path, "intel-rapl:0", 900_000)
    p1 = _package(tmp_path, "intel-rapl:1", 100_000)
    _package(tmp_path, "intel-rapl:0:0", 5)  # a sub-domain (the cores): counted in its package
    meter = E.rapl_meter(str(tmp_path))
    assert meter.source == "rapl" and len(meter.counters) == 2
    before = meter.read()
    (p0 / "energy_uj").write_text("200000\n")  # wrapped at 1 J: 0.1 J to the wrap, then 0.2 J
    (p1 / "energy_uj").write_text("400000\n")  # 0.3 J
    assert meter.joules_between(before, meter.read()) == pytest.approx(0.1 + 0.2 + 0.3, abs=1e-12)


def test_an_unreadable_or_missing_rapl_counter_is_no_meter(tmp_path):
    assert E.rapl_meter(str(tmp_path)) is None
    d = _package(tmp_path, "intel-rapl:0", 1)
    (d / "energy_uj").unlink()
    (d / "energy_uj").mkdir()  # reading it fails as an unreadable counter does (an OSError)
    (tmp_path / "intel-rapl:1").mkdir()  # a package without a counter
    _package(tmp_path, "intel-rapl:2", 0)
    (tmp_path / "intel-rapl:2" / "energy_uj").write_text("not a number\n")
    assert E.rapl_meter(str(tmp_path)) is None


class _FakeNvml:
    """pynvml's calls the meter makes: millijoules per GPU, advanced by the test."""

    def __init__(self, has_counter=True):
        self.mj = {0: 1000, 1: 5000}
        self.has_counter = has_counter

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if not self.has_counter:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.mj[h]


def test_nvml_sums_the_sites_gpus_in_joules_and_a_gpu_without_the_counter_is_no_meter():
    nvml = _FakeNvml()
    meter = E.site_meter("gpu", [0, 1], nvml=nvml)
    assert meter.source == "nvml"
    before = meter.read()
    nvml.mj[0] += 2500
    nvml.mj[1] += 500
    assert meter.joules_between(before, meter.read()) == pytest.approx(3.0)
    assert E.site_meter("gpu", [0], nvml=_FakeNvml(has_counter=False)) is None


def test_a_round_uses_the_counter_where_there_is_one_else_the_model_and_says_which(tmp_path):
    p0 = _package(tmp_path, "intel-rapl:0", 0, wrap_uj=10**12)
    counted = E.RoundEnergy(E.site_meter("cpu", rapl_root=str(tmp_path)), watts=100.0)
    counted.start()
    (p0 / "energy_uj").write_text("7000000\n")
    assert counted.joules(2.0) == (pytest.approx(7.0), "rapl")  # the counter, not 100 W x 2 s
    modelled = E.RoundEnergy(E.site_meter("cpu", rapl_root=str(tmp_path / "none")), watts=100.0)
    modelled.start()
    assert modelled.joules(2.0) == (200.0, "model")
    nothing = E.RoundEnergy(None, watts=None)
    nothing.start()
    assert nothing.joules(2.0) == (None, None)
