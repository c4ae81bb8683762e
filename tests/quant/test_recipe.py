"""Recipe flags: each maps to the numerics the spec gives it; bad input is a clear error."""

import dataclasses

import pytest

from nvfp4_jax.quant.recipe import RECIPES, Recipe, get_recipe, recipe_name


@pytest.mark.parametrize(
    "flag, fmt, two_d, rht, sr",
    [
        ("te_nvfp4", "nvfp4", True, True, True),
        ("te_nvfp4_no_rht", "nvfp4", True, False, True),
        ("nvfp4_no_sr", "nvfp4", True, True, False),
        ("nvfp4_1d_weights", "nvfp4", False, True, True),
        ("mxfp4", "mxfp4", False, False, False),
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
    delayed = get_recipe("te_fp8_delayedscaling")
    assert delayed.fp8_delayed and (delayed.amax_history_len, delayed.margin) == (1024, 0)
    assert not get_recipe("te_fp8_currentscaling").fp8_delayed


def test_recipe_passes_through_and_is_frozen():
    r = get_recipe("te_nvfp4")
    assert get_recipe(r) is r
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
        (dict(format="fp8", rht_wgrad=True), "NVFP4 options"),
        (dict(format="fp8", fp8_scaling="lazy"), "Recipe.fp8_scaling='lazy'"),
        (dict(format="fp8", amax_history_len=0), "amax_history_len=0"),
    ],
)
def test_invalid_recipe_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Recipe(**kwargs)
