"""A site trains with the project's own train step: one site holding all the data, averaging
only with itself, follows plain training step for step."""

import json
import os

import jax
import numpy as np
import pytest

from nvfp4_jax.config import make_config
from nvfp4_jax.federated.contract import UpdateContract
from nvfp4_jax.federated.site import SiteTrainer, flat_params

pytestmark = pytest.mark.slow

KEYS = {"model_name": "tiny", "base_num_decoder_layers": 2, "quantization": "te_nvfp4", "max_target_length": 32,
        "per_device_batch_size": 2, "steps": 6, "eval_interval": 100, "eval_steps": 1, "log_period": 1, "seed": 3}


def test_one_site_with_all_the_data_is_plain_training(tmp_path):
    from nvfp4_jax.train.loop import run

    devices = jax.devices()[:1]
    plain = make_config(KEYS, {"base_output_directory": str(tmp_path), "run_name": "plain",
                               "enable_checkpointing": "false"})
    run(plain, progress=False, devices=devices)
    with open(os.path.join(tmp_path, "plain", "metrics.jsonl")) as f:
        plain_losses = [r["loss"] for r in map(json.loads, f) if "loss" in r and "step" in r][:6]

    site = SiteTrainer(make_config(KEYS), UpdateContract(kind="diff"), devices=devices)
    params = site.initial_params()
    site_losses = []
    for _ in range(3):  # 3 rounds x 2 steps; FedAvg over one site returns its own parameters
        result = site.train_round(params, 4)
        site_losses.append(result.train_loss)
        params = result.params
    # Per round the site reports its mean loss: the plain run's losses, pairwise, bit for bit
    # (same init, same batches, same step, the optimizer state kept on the site). Both means are
    # np.mean of the same two float32 values in float64 (their sum is exact there): equal.
    expected = [float(np.mean(np.asarray(plain_losses[i:i + 2], np.float64))) for i in (0, 2, 4)]
    assert site_losses == expected


def test_a_frozen_backbone_changes_only_the_trainable_leaves():
    site = SiteTrainer(make_config(KEYS), UpdateContract(kind="subset", trainable="mlp"), devices=jax.devices()[:1])
    before = site.initial_params()
    result = site.train_round(before, 2)
    assert sorted(result.params) == sorted(k for k in before if "/mlp/" in k)
    after = flat_params(site.state.params)
    frozen = [k for k in before if "/mlp/" not in k]
    assert all(np.array_equal(after[k], before[k]) for k in frozen)
    assert all(not np.array_equal(after[k], before[k]) for k in result.params)
