"""`python -m nvfp4_jax.plan`'s numeric options: refused in one line unless positive and finite."""

import pytest

from nvfp4_jax import plan


@pytest.mark.parametrize("option", [
    ["--num-devices", "0"], ["--num-devices", "-8"],
    ["--device-memory-gib", "inf"], ["--device-memory-gib", "nan"], ["--device-memory-gib", "0"],
    ["--device-memory-gib", "-1"],
])
def test_plan_refuses_non_positive_or_non_finite_numbers(option, capsys):
    assert plan.main(["model_name=tiny", *option]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no plan printed
    name, value = option
    assert err.splitlines() == [
        f"error: {name}={float(value) if 'gib' in name else int(value)!r} is not allowed: "
        "must be a positive, finite number."]


def test_plan_accepts_positive_numbers(capsys):
    assert plan.main(["model_name=tiny", "--num-devices", "8", "--device-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "-" not in out.split("model FLOPs per step:")[1].split()[0]
