"""Per-device shares inside a silo (`federated/silo.py`): unequal shares train what FSDP over the
same devices trains (the batch's token-weighted mean gradient), and the controller moves
microbatches away from a slow device, round by round."""

import jax
import numpy as np
import pytest

from nvfp4_jax.config import make_config
from nvfp4_jax.federated import shares
from nvfp4_jax.federated.contract import UpdateContract
from nvfp4_jax.federated.budget import SiloPolicy, check_silo
from nvfp4_jax.federated.site import SiteTrainer

KEYS = {"model_name": "tiny", "base_num_decoder_layers": 1, "quantization": "bf16", "dtype": "float32",
        "max_target_length": 16, "per_device_batch_size": 2, "steps": 8, "eval_steps": 1, "seed": 5}


def _rel(a: dict, b: dict) -> float:
    x = np.concatenate([np.ravel(a[k]) for k in sorted(a)])
    y = np.concatenate([np.ravel(b[k]) for k in sorted(b)])
    return float(np.abs(x - y).max() / np.abs(y).max())


def _tree_rel(a, b) -> float:
    x, y = (np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(t)]) for t in (a, b))
    return float(np.abs(x - y).max() / np.abs(y).max())


def test_the_step_needs_a_microbatch_for_every_device_that_divides_its_rows():
    assert check_silo(SiloPolicy("adaptive", microbatch=1), 2, 4) == 4
    assert check_silo(SiloPolicy("equal", microbatch=2), 2, 4) == 2
    with pytest.raises(ValueError, match="divide the site's 4 rows"):
        check_silo(SiloPolicy("adaptive", microbatch=3), 2, 4)
    with pytest.raises(ValueError, match="every device needs at least one"):
        check_silo(SiloPolicy("adaptive", microbatch=4), 2, 4)
    with pytest.raises(ValueError, match="one of off, equal, static, adaptive"):
        check_silo(SiloPolicy("fastest"), 2, 4)


@pytest.mark.slow  # ~15 s on CPU: two sites of the one-layer tiny model, two rounds each
def test_unequal_device_shares_train_what_fsdp_trains_and_follow_a_slow_device():
    devices = jax.devices()[:2]
    cfg = make_config(KEYS)
    fsdp = SiteTrainer(cfg, UpdateContract(kind="diff"), devices=devices)
    silo = SiteTrainer(cfg, UpdateContract(kind="diff"), devices=devices,
                       silo=SiloPolicy("adaptive", microbatch=1, ema=1.0, deadband=0.0), device_slowdown=(1.0, 6.0))
    params = fsdp.initial_params()
    assert _rel(silo.initial_params(), params) == 0.0
    # Round 1: an equal split (nothing measured yet), 2 steps of 4 rows.
    a, b = fsdp.train_round(params, 8), silo.train_round(params, 8)
    first = silo.silo_record
    assert first["trained_with"] == [2, 2]
    # The slowed device (6x) is given fewer microbatches (3:1 unless the measured ratio is below
    # 3); every device keeps at least one.
    assert first["microbatches"][1] < first["microbatches"][0] and min(first["microbatches"]) >= 1
    assert sum(first["microbatches"]) == 4
    # Its busy time is the stretched one: about 6x the other's for the same share (CPU noise: > 3x).
    assert first["busy_s"][1] > 3 * first["busy_s"][0]
    # Round 2 trains the unequal split: the same update as FSDP over the whole batch (fp32,
    # summation order only), the losses the same.
    split = first["microbatches"]
    # The unequal split's combined gradient is the whole batch's token-weighted mean (fp32,
    # summation order only); an equal-weight mean of the devices' mean gradients is not.
    state, batch = silo.state, silo.data.batch(silo.data_step)
    parts, _, _ = silo.silo._parts(state, batch)
    grads, loss = shares.combine([jax.device_put(p, devices[0]) for p in parts])
    whole, whole_loss, n = shares.share_sums(silo.run.model, jax.device_put(state, devices[0]), [batch])
    assert _tree_rel(grads, jax.tree.map(lambda g: g / n, whole)) < 1e-6
    assert abs(float(loss) - float(whole_loss / n)) <= 1e-6 * float(whole_loss / n)
    means = [jax.tree.map(lambda g, c=jax.device_put(p[2], devices[0]): jax.device_put(g, devices[0]) / c, p[0])
             for p in parts]
    assert _tree_rel(jax.tree.map(lambda x, y: (x + y) / 2, *means), grads) > 1e-3
    # Round 2 trains the unequal split: FSDP's round, up to fp32 summation order (which Adam's
    # normalisation lifts to ~1e-5 of the largest parameter), and the same losses.
    c, d = fsdp.train_round(a.params, 8), silo.train_round(a.params, 8)
    assert silo.silo_record["trained_with"] == split != [2, 2]
    assert _rel(b.params, a.params) < 5e-5 and _rel(d.params, c.params) < 5e-5
    assert abs(d.train_loss - c.train_loss) <= 1e-6 * abs(c.train_loss)
    # Training moved the parameters by far more than that.
    assert _rel(c.params, params) > 1e-3


def test_device_slowdowns_need_silo_shares():
    with pytest.raises(ValueError, match="give the silo shares a policy"):
        SiteTrainer(make_config(KEYS), UpdateContract(kind="diff"), devices=jax.devices()[:2],
                    device_slowdown=(1.0, 2.0))
