"""The device checks (nvfp4_jax/device_check.py, run on a GPU by scripts/device_check.sh), on CPU:
each check passes where the CPU is its own accelerator and fails when the bits differ, and the
bit count under them (nvfp4_jax/bitwise.py, also tests/bitwise.py) refuses trees it cannot pair."""

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits, assert_same_floats

from nvfp4_jax import device_check as dc
from nvfp4_jax.bitwise import BitMismatch, bit_diff, leaf_diffs
from nvfp4_jax.nvfp4_spec import tie_rich_data

# --- the bit count ------------------------------------------------------------------------------


def test_bit_diff_counts_elements_whose_bits_differ():
    a = np.array([1.0, -0.0, np.nan, 2.0], np.float32)
    b = np.array([1.0, 0.0, np.nan, np.nextafter(np.float32(2), np.float32(3))], np.float32)
    # -0.0 vs 0.0 and a last-place change are differences; equal NaNs are not.
    assert bit_diff(a, b) == 2
    assert bit_diff({"x": a, "y": jnp.asarray(a, jnp.bfloat16)}, {"x": b, "y": jnp.asarray(b, jnp.bfloat16)}) == 3
    other_nan = a.copy()
    other_nan.view(np.uint32)[2] ^= 1  # another NaN payload
    assert bit_diff(a, other_nan) == 1 and bit_diff(a, other_nan, nan_equal=True) == 0
    assert leaf_diffs({"p": a}, {"p": b}) == [("['p']", 2, 4)]


@pytest.mark.parametrize("got,want,match", [
    ((np.zeros(3),), (np.zeros(3), np.zeros(3)), "structures differ"),  # a missing leaf
    ({"a": np.zeros(3)}, {"b": np.zeros(3)}, "structures differ"),
    (np.zeros(3), np.zeros(4), r"float64\[3\] vs float64\[4\]"),
    (np.zeros(3, np.float32), np.zeros(3, np.int32), "float32"),
])
def test_trees_that_do_not_pair_are_refused_not_zipped(got, want, match):
    with pytest.raises(BitMismatch, match=match):
        bit_diff(got, want)
    with pytest.raises(BitMismatch):
        assert_same_bits(got, want)


def test_assertions_name_the_leaf():
    with pytest.raises(AssertionError, match=r"step 3: \['w'\]: 1 of 2 elements differ"):
        assert_same_bits({"w": np.array([1, 2])}, {"w": np.array([1, 3])}, "step 3")
    assert_same_floats(np.array([np.nan, 1.0], np.float32), np.array([-np.nan, 1.0], np.float32))


# --- the checks, with the CPU as its own accelerator --------------------------------------------


def test_checks_pass_on_cpu_and_compare_with_the_spec():
    accel, cpu = dc.devices()
    assert accel.platform == cpu.platform == "cpu"
    key = jax.random.key(11)
    x = tie_rich_data(0, (32, 64))
    for kw in (dict(), dict(stochastic=True), dict(axis=0, rht=True)):
        ok, detail = dc.check_nvfp4("bf16 ties 1x16", x, kw, key, accel_flushes=True)
        assert ok and detail["cpu_vs_spec"] == 0 and detail["accel_vs_cpu"] == 0, (kw, detail)
    ok, detail = dc.check_fp8("bf16 ties", x, "e4m3")
    assert ok and detail == dict(accel_vs_cpu=0)
    assert dc.check_fp8_delayed_update()[0]


def test_spec_comparison_catches_a_quantizer_one_code_off(monkeypatch):
    real = dc.quantize_nvfp4

    def off_by_one(x, **kw):  # the low nibble of the first byte: one element's code
        q = real(x, **kw)
        return dataclasses.replace(q, codes=q.codes.at[0, 0].set(q.codes[0, 0] ^ 1))

    monkeypatch.setattr(dc, "quantize_nvfp4", off_by_one)
    ok, detail = dc.check_nvfp4("bf16 ties 1x16", tie_rich_data(0, (32, 64)), {}, jax.random.key(1), True)
    assert not ok and detail["cpu_vs_spec"] == 1


@pytest.mark.slow  # interpreted kernels, twice; tests/kernels pin `kernels_vs_reference` fast
def test_kernel_check_shares_the_self_checks_comparison():
    ok, detail = dc.check_kernels("bf16 ties 1x16", tie_rich_data(0, (32, 64)), jax.random.key(3))
    copies = len(dc.SELF_CHECK_COPIES) + len(dc.PACKED_DY_PAIR)
    assert ok and len(detail) == 2 * copies and set(detail.values()) == {0}, detail


def test_gemm_check_on_cpu():
    ok, detail = dc.check_gemm("te_nvfp4", quick=True)
    assert ok and detail["operands_accel_vs_cpu"] == 0 and detail["max_output_rel_diff"] == 0, detail


@pytest.mark.slow
def test_command_runs_every_check_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nvfp4_jax.device_check", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1500)
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert proc.returncode == 0 and report["failed"] == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["passed"] == len(report["checks"]) > 50


def test_a_usage_mistake_is_one_error_line_and_exit_2(capsys):
    assert dc.main(["--quick", "--bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unrecognized arguments: --bogus") and "\n" not in err, err
    assert dc.main(["--help"]) == 0 and "python -m nvfp4_jax.device_check" in capsys.readouterr().out
