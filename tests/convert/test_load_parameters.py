"""`load_parameters_path`: a fresh run starts from converted parameters, sharded as the run
shards them, with a fresh optimizer at step 0; and a run's checkpoint goes back to HF."""

import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from _hf_files import HF_CONFIG
from nvfp4_jax.config import load_config
from nvfp4_jax.train import assembly, params_checkpoint as params_lib
from nvfp4_jax.convert.__main__ import main
from nvfp4_jax.convert.checkpoints import from_hf
from nvfp4_jax.convert.hf import model_keys_from_hf


def _run_args(tmp_path, ours):
    keys = model_keys_from_hf(HF_CONFIG)
    return ([f"{k}={v}" for k, v in keys.items()]
            + ["scan_layers=true", "max_target_length=16", "per_device_batch_size=1",
               "dataset_type=synthetic", f"base_output_directory={tmp_path}", "run_name=run",
               f"load_parameters_path={ours}"])


def test_loaded_parameters_replace_the_initial_ones_shard_by_shard(tmp_path, hf_dir):
    path, hf = hf_dir
    ours = str(tmp_path / "ours")
    from_hf(path, ours, {"scan_layers": "true"})
    cfg = load_config(_run_args(tmp_path, ours))
    parts = assembly.assemble(cfg)  # all 8 test devices, FSDP
    state, state_sh = parts.init_state(seed=0), parts.state_shardings
    loaded = params_lib.load_into(ours, state, state_sh)
    embedding = loaded.params["token_embedder"]["embedding"]
    assert embedding.sharding == state_sh.params["token_embedder"]["embedding"]
    assert len(embedding.addressable_shards) == 8 and embedding.addressable_shards[0].data.shape == (64, 4)
    np.testing.assert_array_equal(np.asarray(embedding), hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(loaded.params["layers"]["mlp"]["down"]["kernel"][2]),
                                  hf["model.layers.2.mlp.down_proj.weight"].T)
    assert int(loaded.step) == 0
    for fresh, kept in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(loaded.opt_state)):
        np.testing.assert_array_equal(np.asarray(fresh), np.asarray(kept))


@pytest.mark.slow
def test_hf_to_training_run_and_back_is_bit_exact_at_learning_rate_zero(tmp_path, hf_dir, capsys):
    from nvfp4_jax.train.loop import run

    path, hf = hf_dir
    ours = str(tmp_path / "ours")
    assert main(["from-hf", path, ours, "scan_layers=true"]) == 0
    # Step 1 runs at the warmup's learning rate 0: its checkpoint holds the loaded parameters.
    cfg = load_config(_run_args(tmp_path, ours) + [
        "steps=2", "warmup_steps_fraction=0.5", "checkpoint_period=1", "eval_interval=1000", "eval_steps=1"])
    summary = run(cfg, progress=False)
    assert summary["step_reached"] == 2 and summary["resumed_from_step"] is None
    assert "Parameters from load_parameters_path=" in capsys.readouterr().out
    run_dir = summary["run_directory"]
    assert main(["to-hf", os.path.join(run_dir, "checkpoints", "1"), str(tmp_path / "back1")]) == 0
    back = load_file(str(tmp_path / "back1" / "model.safetensors"))
    assert set(back) == set(hf)
    for name, array in hf.items():
        np.testing.assert_array_equal(back[name], array, err_msg=name)
    # The run directory itself: its newest checkpoint (step 2, trained at a nonzero rate).
    assert main(["to-hf", run_dir, str(tmp_path / "back2")]) == 0
    newest = load_file(str(tmp_path / "back2" / "model.safetensors"))
    assert not np.array_equal(newest["model.layers.0.mlp.up_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"])
    assert os.listdir(os.path.join(run_dir, "tensorboard"))


def test_training_with_another_models_parameters_stops_in_one_line_before_compiling(tmp_path, hf_dir, capsys):
    from nvfp4_jax.train.__main__ import main as train_main

    ours = str(tmp_path / "ours")
    from_hf(hf_dir[0], ours, {"scan_layers": "true"})
    args = _run_args(tmp_path, ours)
    assert train_main([a for a in args if not a.startswith("base_mlp_dim")] + ["base_mlp_dim=96"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: load_parameters_path=") and err.count("\n") == 1
    assert "base_mlp_dim=48 (this run: 96); run with base_mlp_dim=48" in err
    assert train_main(args[:-1] + [f"load_parameters_path={tmp_path / 'missing'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")  # refused before the run directory was made
