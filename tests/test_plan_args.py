"""`python -m nvfp4_jax.plan`'s numeric options: refused in one line unless positive and finite."""

import pytest

from nvfp4_jax import plan
from nvfp4_jax.cli import Exit


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


def test_plan_refuses_a_memory_size_whose_bytes_overflow(capsys):
    # 1e300 GiB is a finite float, but 1e300 * 2**30 bytes is inf, and inf "fits" anything.
    assert plan.main(["model_name=tiny", "--device-memory-gib", "1e300"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: --device-memory-gib=1e+300 is not allowed")


def test_max_context_stops_at_the_trainers_int32_limit(capsys):
    from nvfp4_jax.config import INT32_MAX, load_config

    # A tiny model on a device this large fits any length: the search must stop where the trainer
    # (config.validate: every integer key within int32) stops accepting max_target_length.
    assert plan.main(["model_name=tiny", "--device-memory-gib", "1e15", "--max-context"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    length = int(line.split("max_target_length=")[1].split()[0].replace(",", ""))
    assert length <= INT32_MAX and length + 16 > INT32_MAX
    assert "the trainer's limit, max_target_length <= 2,147,483,647" in line
    load_config(["model_name=tiny", f"max_target_length={length}"])  # the trainer accepts it


def test_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as done:
        plan.main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "exit codes: 0 planned" in text and "2 bad input" in text
    assert f"{Exit.DOES_NOT_FIT:d} planned, but it does not fit the device" in text and "1 is a crash" in text


def test_a_plan_that_does_not_fit_is_printed_and_exits_with_its_own_code(capsys):
    assert plan.main(["model_name=tiny", "--device-memory-gib", "1e-9"]) == Exit.DOES_NOT_FIT == 5
    captured = capsys.readouterr()
    assert "fits: NO" in captured.out and captured.err == ""
