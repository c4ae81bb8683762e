"""`--update adapters`: sites train LoRA adapters beside a frozen backbone, and only the adapters
cross the network, both ways; federated.json records what full-model FedAvg would have moved."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nvfp4_jax.config import ConfigError
from nvfp4_jax.federated import contract as C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = ["layers_0/mlp/up/kernel", "layers_0/mlp/up/lora_a", "layers_0/mlp/up/lora_b",
         "layers_0/attention/query/kernel", "layers_0/attention/query/lora_a", "layers_0/attention/query/lora_b",
         "lm_head/kernel", "token_embedder/embedding"]


def test_the_adapters_contract_sends_exactly_the_adapter_matrices():
    adapters = C.UpdateContract(kind="adapters")
    C.check_contract(adapters)
    assert adapters.sends_difference and adapters.frozen_backbone
    assert C.trainable_paths(adapters, PATHS, 1) == [p for p in PATHS if "lora" in p]
    with pytest.raises(ValueError, match="needs a model with LoRA adapters: set lora_rank > 0"):
        C.trainable_paths(adapters, [p for p in PATHS if "lora" not in p], 1)
    # With `trainable`: the adapters and the leaves it selects (a VLM's projector, say).
    with_mlp = C.UpdateContract(kind="adapters", trainable="mlp")
    C.check_contract(with_mlp)
    assert C.trainable_paths(with_mlp, PATHS, 1) == [p for p in PATHS if "lora" in p or "/mlp/" in p]
    vlm = ["projector/dense_0/kernel", "vision/layers_0/mlp/up/kernel", *(f"decoder/{p}" for p in PATHS)]
    assert C.trainable_paths(C.UpdateContract(kind="adapters", trainable="projector"), vlm, 1) == [
        p for p in vlm if "lora" in p or p.startswith("projector/")]
    with pytest.raises(ValueError, match="needs update=subset or update=adapters"):
        C.check_contract(C.UpdateContract(kind="diff", trainable="projector"))
    assert not C.UpdateContract(kind="diff").frozen_backbone


def test_the_server_sends_only_the_trained_leaves_and_keeps_the_whole_global_model():
    pytest.importorskip("nvflare")
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from nvfp4_jax.federated.server import BudgetedFedAvg

    params = {p: np.ones(3, np.float32) for p in PATHS}
    ctrl = BudgetedFedAvg(run_config={"base_num_decoder_layers": 1, "lora_rank": 2}, site_names=["site-1"],
                          update_contract={"kind": "adapters"})
    model = FLModel(params=dict(params), params_type=ParamsType.FULL, meta={"x": 1})
    sent = ctrl._sent_model(model)
    assert sorted(sent.params) == sorted(p for p in PATHS if "lora" in p) and sent.meta == {"x": 1}
    assert sorted(model.params) == sorted(PATHS)  # the global model is not cut
    full = BudgetedFedAvg(run_config={}, site_names=["site-1"], update_contract={"kind": "diff"})
    assert full._sent_model(model) is model


@pytest.mark.parametrize("argv, message", [
    (["--update", "adapters"], "--update adapters sends the LoRA adapters: give the model some (lora_rank=8, say)"),
    (["--update", "adapters", "lora_rank=4", "train_params=all"], "--update adapters trains the adapters alone"),
])
def test_bad_adapter_jobs_are_one_line_errors(tmp_path, argv, message):
    pytest.importorskip("nvflare")
    from nvfp4_jax.federated.__main__ import build_spec

    with pytest.raises(ConfigError) as err:
        build_spec([*argv, f"base_output_directory={tmp_path}"])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.slow
def test_two_sites_train_adapters_of_a_frozen_nvfp4_backbone_and_move_only_them(tmp_path):
    pytest.importorskip("nvflare")
    proc = subprocess.run(
        [sys.executable, "-m", "nvfp4_jax.federated", "--sites", "2", "--rounds", "2", "--update", "adapters",
         "lora_rank=4", "quantization=te_nvfp4", "base_num_decoder_layers=1", "max_target_length=32",
         "per_device_batch_size=1", "eval_steps=1", "learning_rate=1e-2", f"base_output_directory={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "federated" / "federated.json") as f:
        rounds = json.load(f)["rounds"]
    model = np.load(tmp_path / "federated" / "global_model.npz")
    adapter_bytes = sum(model[k].nbytes for k in model.files if k.rsplit("/", 1)[-1] in ("lora_a", "lora_b"))
    full_bytes = sum(model[k].nbytes for k in model.files)
    for r in rounds[1:]:
        assert r["full_model_bytes"] == full_bytes
        # Each way, per site: the adapters' float32 bytes, not the model's.
        assert r["downlink_bytes_per_site"] == adapter_bytes
        assert all(s["payload_bytes"] == adapter_bytes for s in r["sites"].values())
        assert r["bytes_sent"] == 2 * adapter_bytes and full_bytes > 10 * adapter_bytes
    assert rounds[2]["validation_loss"] < rounds[0]["validation_loss"]
    # The global backbone is the initial one, bit for bit; the adapters moved (B started at 0).
    from nvfp4_jax.config import load_config
    from nvfp4_jax.federated.site import Evaluator

    keys = ["lora_rank=4", "quantization=te_nvfp4", "base_num_decoder_layers=1", "max_target_length=32"]
    initial = Evaluator(load_config(keys), num_batches=1).initial_params()
    for name in model.files:
        if name.endswith("lora_b"):
            assert np.abs(model[name]).max() > 0, name
        elif not name.endswith("lora_a"):
            np.testing.assert_array_equal(model[name], initial[name], err_msg=name)
