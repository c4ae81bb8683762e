import dataclasses
import glob
import json
import os

import pytest

from nvfp4_jax import config as config_lib
from nvfp4_jax.config import ConfigError, load_config
from nvfp4_jax.train import resume

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_come_from_the_dataclasses():
    # The default model_name is "tiny": its preset applies over the dataclass defaults.
    cfg = load_config([])
    want = dataclasses.replace(config_lib.ModelConfig(), **config_lib.MODEL_PRESETS["tiny"])
    assert cfg.model == want
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
        # keys and values as text
        (["quantisation=te_nvfp4"], r"Unknown config key 'quantisation'.*Did you mean 'quantization'"),
        (["steps=1.5"], r"steps='1.5': expected int"),
        (["enable_checkpointing=maybe"], r"expected a boolean"),
        (["steps=3", "oops"], r"Expected key=value, got .oops."),
        (["model_name=gpt5"], r"model_name='gpt5'.*llama3-8b"),
        # the model's shape
        (["quantization=nvfp5"], r"quantization='nvfp5'.*te_nvfp4"),
        (["base_num_kv_heads=3"], r"base_num_kv_heads=3.*must divide base_num_query_heads=4"),
        (["base_emb_dim=-128"], r"base_emb_dim=-128.*positive"),
        (["bf16_first_layers=3", "bf16_last_layers=2"], r"bf16_first_layers \+ bf16_last_layers"),
        (["normalization_layer_epsilon=0"], r"normalization_layer_epsilon=0.0 .*> 0"),
        # block-scaled recipes need whole blocks
        (["quantization=te_nvfp4", "base_mlp_dim=392"], r"base_mlp_dim=392.*multiple of 16"),
        (["quantization=mxfp4", "base_mlp_dim=400"], r"base_mlp_dim=400.*multiple of 32"),
        (["quantization=te_nvfp4", "max_target_length=60"], r"max_target_length=60 .*multiple of 16"),
        (["quantization=mxfp4", "max_target_length=48"], r"max_target_length=48 .*multiple of 32"),
        # the optimizer
        (["adam_eps=0"], r"adam_eps=0.0 .*must be > 0"),
        (["adam_b1=2"], r"adam_b1=2.0 .*\[0, 1\)"),
        (["adam_b2=1"], r"adam_b2=1.0 .*\[0, 1\)"),
        (["adam_b1=-0.1"], r"adam_b1=-0.1 .*\[0, 1\)"),
        (["adam_weight_decay=-0.1"], r"adam_weight_decay=-0.1 .*>= 0"),
        # non-finite numbers and steps
        (["learning_rate=inf"], r"learning_rate=inf .*finite"),
        (["learning_rate=nan"], r"learning_rate=nan .*finite"),
        (["eval_fraction=nan"], r"eval_fraction=nan .*finite"),
        (["quantization_end_step=-5"], r"quantization_end_step=-5"),
        # data and output paths
        (["dataset_type=text"], r"dataset_path.*needs a file path"),
        (["run_name=../../x"], r"run_name='../../x' .*inside base_output_directory"),
        (["run_name=a/../../x"], r"run_name='a/../../x'"),
        (["run_name=/tmp/x"], r"run_name='/tmp/x'"),
        (["base_output_directory="], r"base_output_directory=''"),
    ],
)
def test_bad_config_is_a_clear_error(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(args)


def test_missing_yaml_file_is_named():
    with pytest.raises(ConfigError, match="nope.yml"):
        load_config(["nope.yml"])


@pytest.mark.parametrize("args", [["quantization=te_fp8_delayedscaling", "max_target_length=60"],
                                  ["quantization=bf16", "max_target_length=60"],
                                  ["run_name=group/run-1"]])
def test_values_that_only_look_odd_are_accepted(args):
    load_config(args)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("steps: [1, 2\n", r"not valid YAML at line 2"),
        ("steps: 3\n  bad: indent\n", r"not valid YAML at line 2"),
        ("- steps\n", r"must hold a mapping"),
        ("1: 3\n", r"Config key 1 must be a name"),
        (b"\xff\xfe steps: 1", r"not UTF-8"),
    ],
)
def test_bad_yaml_is_a_clear_error(tmp_path, text, pattern):
    path = tmp_path / "c.yml"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    with pytest.raises(ConfigError, match=pattern):
        load_config([str(path)])


def test_a_directory_as_yaml_path_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config([str(tmp_path)])


def test_fp8_needs_no_block_multiple():
    # Per-tensor FP8 blocks nothing; NVFP4 and MXFP4 need multiples of 16 and 32.
    assert load_config(["quantization=te_fp8_currentscaling", "base_emb_dim=24"]).model.base_emb_dim == 24
    with pytest.raises(ConfigError, match="base_emb_dim=24 is not allowed: quantization='te_nvfp4' needs a multiple of 16"):
        load_config(["quantization=te_nvfp4", "base_emb_dim=24"])


def test_resume_mutable_keys_are_real_keys():
    assert set(resume.RESUME_MUTABLE_KEYS) <= set(config_lib.KEY_SECTIONS)
    # What a run computes may never change under a resume.
    for key in ("quantization", "learning_rate", "seed", "base_emb_dim", "dataset_type", "adam_eps"):
        assert key not in resume.RESUME_MUTABLE_KEYS


def test_resume_differences_lists_exactly_the_immutable_changes():
    old = load_config(["quantization=te_nvfp4", "steps=10", "seed=1"])
    new = load_config(["quantization=bf16", "steps=20", "seed=2", "log_period=3", "learning_rate=1e-3"])
    diffs = resume.config_differences(config_lib.to_dict(old), new)
    assert diffs == [("quantization", "te_nvfp4", "bf16"), ("learning_rate", 3e-3, 1e-3), ("seed", 1, 2)]
    assert resume.config_differences(config_lib.to_dict(old), old) == []
    # A key one side does not know (another version's config) is a difference, not a guess.
    saved = config_lib.to_dict(old)
    del saved["model"]["bf16_last_layers"]
    saved["model"]["retired_key"] = 1
    assert resume.config_differences(saved, old) == [
        ("bf16_last_layers", "(not recorded)", 0), ("retired_key", 1, "(not recorded)")]


def test_json_round_trip(tmp_path):
    cfg = load_config(["quantization=te_fp8_delayedscaling", "steps=11"])
    path = tmp_path / "config.json"
    config_lib.save_json(cfg, str(path))
    assert config_lib.from_dict(json.loads(path.read_text())) == cfg


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "recipes", "configs", "*.yml"))))
def test_every_recipe_yaml_parses(path):
    cfg = load_config([path])
    assert cfg.model.model_name in config_lib.MODEL_PRESETS


def test_a_repeated_yaml_key_is_refused_with_both_lines(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("steps: 5\nmodel_name: tiny\nsteps: 7\n")
    with pytest.raises(ConfigError, match=r"the key 'steps' appears twice \(lines 1 and 3\)"):
        load_config([str(path)])
    path.write_text("steps: 5\nmodel_name: tiny\n")  # the same file without the repeat loads
    assert load_config([str(path)]).train.steps == 5


@pytest.mark.parametrize("key", ["steps", "checkpoint_period", "eval_interval", "quantization_end_step", "seed"])
def test_integer_keys_are_bounded_to_int32(key):
    with pytest.raises(ConfigError, match=rf"{key}=100000000000 is not allowed: must lie within \+-2147483647"):
        load_config([f"{key}=100000000000"])
    assert getattr(load_config([f"{key}=2147483647"]).train, key) == 2**31 - 1  # the largest that fits


def test_the_cli_refuses_a_too_large_steps_before_creating_anything(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "nvfp4_jax.train", "steps=100000000000", f"base_output_directory={tmp_path}/out"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: steps=100000000000 is not allowed: must lie within +-2147483647 (the step counter, the "
        "schedules and the data positions are int32 on the device)."]
    assert not os.path.exists(tmp_path / "out")
