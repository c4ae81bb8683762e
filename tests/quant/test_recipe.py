"""Recipe flags: each maps to the numerics the spec gives it; bad input is a clear error."""

import dataclasses

import pytest

from nvfp4_jax.config import QUANTIZATION_FLAGS
from nvfp4_jax.quant.recipe import RECIPES, Recipe, get_recipe, operand_specs, recipe_name
from nvfp4_jax.quant.spec import ROLES, OperandSpec


@pytest.mark.parametrize(
    "flag, fmt, two_d, rht, sr",
    [
        ("te_nvfp4", "nvfp4", True, True, True),
        ("te_nvfp4_no_rht", "nvfp4", True, False, True),
        ("nvfp4_no_sr", "nvfp4", True, True, False),
        ("nvfp4_1d_weights", "nvfp4", False, True, True),
        ("mxfp4", "mxfp4", False, False, False),
        ("mxfp4_nvfp4_recipe", "mxfp4", True, True, True),
        ("te_fp8_currentscaling", "fp8", False, False, False),
        ("te_fp8_delayedscaling", "fp8", False, False, False),
        ("bf16", "bf16", False, False, False),
        ("", "bf16", False, False, False),
    ],
)
def test_flag_numerics(flag, fmt, two_d, rht, sr):
    r = get_recipe(flag)
    assert (r.format, r.two_d_weights, r.rht_wgrad, r.sr_gradients) == (fmt, two_d, rht, sr)
    assert r.needs_rng == sr


def test_block_sizes_and_fp8_defaults():
    assert get_recipe("te_nvfp4").block_size == 16
    assert get_recipe("mxfp4").block_size == 32
    assert get_recipe("mxfp4_nvfp4_recipe").block_size == 32
    delayed = get_recipe("te_fp8_delayedscaling")
    assert delayed.fp8_delayed and (delayed.amax_history_len, delayed.margin) == (1024, 0)
    assert not get_recipe("te_fp8_currentscaling").fp8_delayed


def test_a_flag_is_one_frozen_recipe_and_a_recipe_is_not_a_flag():
    r = get_recipe("te_nvfp4")
    assert get_recipe("te_nvfp4") is r
    # Below the config everything takes the Recipe: get_recipe resolves flags only, once.
    with pytest.raises(ValueError, match="unknown quantization recipe"):
        get_recipe(r)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.rht_wgrad = False  # type: ignore[misc]
    assert hash(r) == hash(get_recipe("te_nvfp4"))


def test_recipe_name():
    assert recipe_name(dataclasses.replace(get_recipe("te_nvfp4"), rht_wgrad=False)) == "te_nvfp4_no_rht"
    assert recipe_name(get_recipe("")) == "bf16"
    odd = Recipe(format="fp8", margin=2)
    assert recipe_name(odd) == repr(odd)


def test_unknown_flag_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown quantization recipe 'te_nvfp5'") as err:
        get_recipe("te_nvfp5")
    for flag in ("te_nvfp4", "te_fp8_delayedscaling", "mxfp4", "nvfp4_1d_weights"):
        assert repr(flag) in str(err.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(format="nvfp3"), "Recipe.format='nvfp3'"),
        (dict(format="nvfp4", block_size=32), "requires block_size=16"),
        (dict(format="nvfp4"), "requires block_size=16"),
        (dict(format="fp8", rht_wgrad=True), r"FP4 options \(nvfp4, mxfp4\); format='fp8'"),
        (dict(format="fp8", sr_gradients=True), r"FP4 options \(nvfp4, mxfp4\); format='fp8'"),
        (dict(format="bf16", two_d_weights=True), r"FP4 options \(nvfp4, mxfp4\); format='bf16'"),
        (dict(format="mxfp4", two_d_weights=True), "requires block_size=32"),
        (dict(format="fp8", fp8_scaling="lazy"), "Recipe.fp8_scaling='lazy'"),
        (dict(format="fp8", amax_history_len=0), "amax_history_len=0"),
    ],
)
def test_invalid_recipe_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Recipe(**kwargs)


def test_mxfp4_nvfp4_recipe_is_te_nvfp4_with_the_mxfp4_format():
    """Only the format differs: every role, axis, tile, RHT and SR flag is te_nvfp4's."""
    r = RECIPES["mxfp4_nvfp4_recipe"]
    assert r == dataclasses.replace(RECIPES["te_nvfp4"], format="mxfp4", block_size=32)
    assert "mxfp4_nvfp4_recipe" in QUANTIZATION_FLAGS and recipe_name(r) == "mxfp4_nvfp4_recipe"
    specs = operand_specs(r)
    assert specs == operand_specs(RECIPES["te_nvfp4"])
    assert tuple(specs) == ROLES and specs["w_dgrad"] is None and specs["w"].two_d
    assert {role for role, s in specs.items() if s and s.rht} == {"x_wgrad", "dy_wgrad"}
    assert {role for role, s in specs.items() if s and s.stochastic} == {"dy", "dy_wgrad"}
    assert r.needs_rng


def test_plain_mxfp4_specs_are_unchanged():
    """1x32 blocks along each GEMM's contraction axis, W requantized along N, all RN."""
    assert operand_specs(RECIPES["mxfp4"]) == {
        "x": OperandSpec("x", axis=1), "w": OperandSpec("w", axis=0), "dy": OperandSpec("dy", axis=1),
        "w_dgrad": OperandSpec("w_dgrad", axis=1), "x_wgrad": OperandSpec("x_wgrad", axis=0),
        "dy_wgrad": OperandSpec("dy_wgrad", axis=0),
    }
    assert not RECIPES["mxfp4"].needs_rng
    # An MXFP4 recipe without SR but with the other two needs no key.
    assert not Recipe(format="mxfp4", block_size=32, two_d_weights=True, rht_wgrad=True).needs_rng
