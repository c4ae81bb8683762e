"""Per-process shares of a fixed global batch: the token-weighted combination of unequal shares is
the whole batch's gradient; the budget controller moves microbatches away from a slow worker."""

import jax
import pytest
import numpy as np

from nvfp4_jax.config import load_config
from nvfp4_jax.federated import shares
from nvfp4_jax.federated.budget import BudgetPolicy, SiteCost, smooth
from nvfp4_jax.train import assembly

FP32 = ["model_name=tiny", "base_num_decoder_layers=1", "max_target_length=16", "per_device_batch_size=8",
        "ici_fsdp_parallelism=1", "quantization=bf16", "dtype=float32", "eval_steps=1"]
M = 2  # rows per microbatch; the global batch of 8 rows is 4 microbatches


def _rel(a, b):
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.slow  # 15-25 s on CPU: the tiny model's gradient, eagerly, on five batches
def test_unequal_shares_combined_token_weighted_are_the_whole_batch_gradient():
    run = assembly.assemble(load_config(FP32), jax.devices()[:1])
    state = run.init_state()
    batch = run.dataset("train").batch(0)
    # One document per row with some targets masked, so that microbatches count different numbers of tokens.
    shape = batch["targets"].shape
    # Row r counts the targets whose position is not a multiple of r + 2.
    counted = (np.arange(shape[1])[None, :] % (np.arange(shape[0])[:, None] + 2)) != 0
    batch = dict(batch, targets_segmentation=counted.astype(np.int32))
    batch["inputs_segmentation"] = np.ones_like(batch["inputs"])
    batch["inputs_position"] = np.broadcast_to(np.arange(batch["inputs"].shape[1]), batch["inputs"].shape).copy()
    micro = [{k: v[i * M:(i + 1) * M] for k, v in batch.items()} for i in range(4)]
    whole_grads, whole_loss, _ = shares.share_sums(run.model, state, [batch])
    n = shares.token_count(batch)
    whole = jax.tree.map(lambda g: g / n, whole_grads)
    parts = [shares.share_sums(run.model, state, micro[:3]), shares.share_sums(run.model, state, micro[3:])]
    grads, loss = shares.combine(parts)
    assert _rel(grads, whole) < 1e-6
    assert abs(float(loss) - float(whole_loss / n)) <= 1e-6 * abs(float(whole_loss / n))
    # The whole batch's gradient is also what the project's train step differentiates.
    _, metrics = run.train_step(state, run.put(batch))
    assert abs(float(metrics["loss"]) - float(loss)) <= 1e-6 * float(loss)
    # An equal-weight mean of the two workers' mean gradients is not it.
    means = [jax.tree.map(lambda g, c=p[2]: g / c, p[0]) for p in parts]
    wrong = jax.tree.map(lambda a, b: (a + b) / 2, *means)
    assert _rel(wrong, whole) > 1e-3


@pytest.mark.slow  # 10-15 s on CPU: the tiny model's NVFP4 gradient on a few microbatches
def test_nvfp4_microbatches_round_with_keys_of_their_position_not_of_their_worker():
    cfg = [a if not a.startswith("quantization=") else "quantization=te_nvfp4" for a in FP32]
    run = assembly.assemble(load_config(cfg), jax.devices()[:1])
    state = run.init_state()
    batch = run.dataset("train").batch(0)
    micro = [{k: v[i * M:(i + 1) * M] for k, v in batch.items()} for i in range(4)]
    grad_fn = shares.share_grad_fn(run.model)
    # Shares 3:1 give the one-worker gradient: each microbatch rounds the same wherever it runs.
    one = shares.combine([shares.share_sums(run.model, state, micro, grad_fn=grad_fn)])
    two = shares.combine([shares.share_sums(run.model, state, micro[:3], grad_fn=grad_fn),
                          shares.share_sums(run.model, state, micro[3:], first_index=3, grad_fn=grad_fn)])
    assert _rel(two[0], one[0]) < 1e-6 and float(two[1]) == pytest.approx(float(one[1]), rel=1e-6)
    # The same rows at another position round with other random bits (one key for every
    # microbatch would repeat the same noise K times); at the same position, with the same bits.
    at = [shares.share_sums(run.model, state, micro[:1], first_index=i, grad_fn=grad_fn)[0] for i in (0, 1, 1)]
    assert _rel(at[1], at[2]) == 0.0
    assert _rel(at[0], at[1]) > 1e-3


def test_controller_moves_shares_away_from_a_slow_worker_and_never_drops_one():
    policy = BudgetPolicy(name="adaptive", total_samples=4, quantum=1, ema=0.5, deadband=0.05)
    costs, split = [SiteCost(), SiteCost()], [2, 2]
    assert shares.split_shares(policy, costs, None, 0) == [2, 2]  # unmeasured: equal
    # Worker 0 is 4x slower per microbatch.
    costs = [smooth(c, seconds, k, None, policy.ema) for c, seconds, k in zip(costs, (8.0, 2.0), split)]
    split = shares.split_shares(policy, costs, split, 1)
    assert split == [1, 3] and sum(split) == 4
    # Even 1000x slower it keeps its one microbatch.
    costs = [SiteCost(1000.0), SiteCost(1.0)]
    assert shares.split_shares(policy, costs, split, 2) == [1, 3]
