import glob
import json
import os

import pytest

from nvfp4_jax import config as config_lib
from nvfp4_jax.config import ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_come_from_the_dataclasses():
    cfg = load_config([])
    assert cfg.model == config_lib.ModelConfig()
    assert cfg.train == config_lib.TrainConfig()


def test_cli_overrides_are_typed_and_win_over_yaml(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("steps: 7\nlearning_rate: 1.0e-2\nquantization: te_nvfp4\n")
    cfg = load_config([str(path), "steps=9", "enable_checkpointing=false", "train.seed=3"])
    assert cfg.train.steps == 9 and isinstance(cfg.train.steps, int)
    assert cfg.train.learning_rate == pytest.approx(1e-2)
    assert cfg.model.quantization == "te_nvfp4"
    assert cfg.train.enable_checkpointing is False
    assert cfg.train.seed == 3


def test_model_preset_applies_under_explicit_keys():
    cfg = load_config(["model_name=llama3-8b", "base_num_decoder_layers=2"])
    assert cfg.model.base_emb_dim == 4096 and cfg.model.base_mlp_dim == 14336
    assert cfg.model.base_num_decoder_layers == 2


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["quantisation=te_nvfp4"], r"Unknown config key 'quantisation'.*Did you mean 'quantization'"),
        (["quantization=nvfp5"], r"quantization='nvfp5'.*te_nvfp4"),
        (["base_num_kv_heads=3"], r"base_num_kv_heads=3.*must divide base_num_query_heads=4"),
        (["base_emb_dim=-128"], r"base_emb_dim=-128.*positive"),
        (["quantization=te_nvfp4", "base_mlp_dim=392"], r"base_mlp_dim=392.*multiple of 16"),
        (["quantization=mxfp4", "base_mlp_dim=400"], r"base_mlp_dim=400.*multiple of 32"),
        (["steps=1.5"], r"steps='1.5': expected int"),
        (["enable_checkpointing=maybe"], r"expected a boolean"),
        (["model_name=gpt5"], r"model_name='gpt5'.*llama3-8b"),
        (["dataset_type=text"], r"dataset_path.*needs a file path"),
        (["steps=3", "oops"], r"Expected key=value, got .oops."),
        (["bf16_first_layers=3", "bf16_last_layers=2"], r"bf16_first_layers \+ bf16_last_layers"),
    ],
)
def test_bad_config_is_a_clear_error(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(args)


def test_missing_yaml_file_is_named():
    with pytest.raises(ConfigError, match="nope.yml"):
        load_config(["nope.yml"])


def test_json_round_trip(tmp_path):
    cfg = load_config(["quantization=te_fp8_delayedscaling", "steps=11"])
    path = tmp_path / "config.json"
    config_lib.save_json(cfg, str(path))
    assert config_lib.from_dict(json.loads(path.read_text())) == cfg


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "recipes", "configs", "*.yml"))))
def test_every_recipe_yaml_parses(path):
    cfg = load_config([path])
    assert cfg.model.model_name in config_lib.MODEL_PRESETS


def test_every_quantization_flag_is_a_known_recipe():
    from nvfp4_jax.quant import get_recipe

    for flag in config_lib.QUANTIZATION_FLAGS:
        get_recipe(flag)  # raises on an unknown flag
