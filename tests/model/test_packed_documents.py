"""Packed documents through the model: attention and RoPE per document, the loss over counted tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nvfp4_jax.config import ModelConfig
from nvfp4_jax.model import Llama
from nvfp4_jax.train.state import TrainState
from nvfp4_jax.train.step import document_inputs, make_train_step

CFG = ModelConfig(
    vocab_size=64, base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8,
    base_mlp_dim=48, base_num_decoder_layers=2, max_target_length=16, dtype="float32",
    attention_chunk_size=4,  # several blocks, and documents that straddle them
)
L = 16
DOC1, DOC2 = 6, 7  # then 3 padding tokens in row 0

# Tolerances of whole-model quantities, evaluated by two programs (a packed row vs documents
# alone, the loss method vs logits and optax, one device vs eight): a 2-layer forward has no
# practical a-priori fp32 bound, so these are set far from both ends. Their fp32 noise here is
# measured at 2e-8..1e-7 of the loss and up to 3e-7 of the largest logit or gradient; what the
# tests guard against moves them by 4e-3 of the loss or more (the weights ignored, per-row means
# instead of the global one) and by the logits' own size (another document's tokens seen).
LOSS_RTOL = 1e-5  # >= 100x the measured noise, >= 400x below those effects
ELEMENT_TOL = 1e-4  # of the largest element: >= 300x the measured noise


def _model(kernel, **changes):
    return Llama(dataclasses.replace(CFG, **changes), attention_kernel=kernel)


_JITTED = {}


def _apply(kernel, variables, tokens, segment_ids=None, positions=None):
    """Logits of `_model(kernel)`, one jitted function per kernel (compiled once per shape)."""
    if kernel not in _JITTED:
        model = _model(kernel)
        _JITTED[kernel] = jax.jit(lambda v, t, s, p: model.apply(v, t, segment_ids_BxL=s, positions_BxL=p))
    return np.asarray(_JITTED[kernel](variables, tokens, segment_ids, positions))


@pytest.fixture(scope="module")
def variables():
    return jax.jit(Llama(CFG).init)(jax.random.PRNGKey(0), jnp.zeros((1, L), jnp.int32))


def _packed_row(seed=1):
    """One row: document 1 (6 tokens), document 2 (7), padding (3); MaxText's batch keys."""
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(seed), (L + 1,), 1, CFG.vocab_size))
    seg = np.array([1] * DOC1 + [2] * DOC2 + [0] * (L - DOC1 - DOC2))
    pos = np.concatenate([np.arange(DOC1), np.arange(DOC2), np.zeros(L - DOC1 - DOC2, int)])
    targets = tokens[1:].copy()
    targets[DOC1 - 1] = targets[DOC1 + DOC2 - 1] = 0  # a document's last token predicts nothing here
    target_seg = np.where(np.isin(np.arange(L), [DOC1 - 1, DOC1 + DOC2 - 1]), 0, seg)
    batch = {"inputs": tokens[:L], "targets": targets, "inputs_segmentation": seg,
             "inputs_position": pos, "targets_segmentation": target_seg}
    return {k: jnp.asarray(v[None], jnp.int32) for k, v in batch.items()}


def _logits(kernel, variables, batch):
    return _apply(kernel, variables, batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"])


@pytest.mark.parametrize("kernel", ["dot_product", "chunked"])
def test_each_document_is_its_own_sequence(variables, kernel):
    batch = _packed_row()
    packed = _logits(kernel, variables, batch)
    # Changing document 2 leaves document 1's logits exactly as they were.
    other = dict(batch, inputs=batch["inputs"].at[0, DOC1:DOC1 + DOC2].set(
        (batch["inputs"][0, DOC1:DOC1 + DOC2] + 5) % CFG.vocab_size))
    changed = _logits(kernel, variables, other)
    np.testing.assert_array_equal(changed[0, :DOC1], packed[0, :DOC1])
    assert np.abs(changed[0, DOC1:DOC1 + DOC2] - packed[0, DOC1:DOC1 + DOC2]).max() > 1e-3
    # Each document equals the model run on it alone (positions restart at 0 for document 2).
    for lo, hi in ((0, DOC1), (DOC1, DOC1 + DOC2)):
        alone = _apply(kernel, variables, batch["inputs"][:, lo:hi])
        np.testing.assert_allclose(packed[0, lo:hi], alone[0], atol=ELEMENT_TOL * np.abs(alone).max(), rtol=0)


def test_positions_restart_matters(variables):
    # The same tokens and segments with positions 0..L-1: document 2's logits move (RoPE sees
    # other positions; relative positions within it are unchanged, absolute ones not, so only
    # through rounding would they agree).
    batch = _packed_row()
    restarted = _logits("dot_product", variables, batch)
    running = _logits("dot_product", variables, dict(batch, inputs_position=jnp.arange(L, dtype=jnp.int32)[None]))
    np.testing.assert_array_equal(running[0, :DOC1], restarted[0, :DOC1])
    assert np.abs(running[0, DOC1:DOC1 + DOC2] - restarted[0, DOC1:DOC1 + DOC2]).max() > 0


def _cross_entropy64(logits, targets):
    logits = np.asarray(logits, np.float64)
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]


@pytest.mark.parametrize("kernel", ["dot_product", "chunked"])
def test_packed_loss_is_the_per_document_reference(variables, kernel):
    model = _model(kernel)
    batch = _packed_row()
    loss_fn = jax.jit(lambda b: model.apply(
        variables, b["inputs"], b["targets"], method="loss", **document_inputs(b)))
    loss, total_weights = loss_fn(batch)
    # A row of padding only: nothing counted, loss 0 (not 0 / 0).
    empty = loss_fn(dict(batch, targets_segmentation=jnp.zeros_like(batch["targets_segmentation"])))
    assert (float(empty[0]), float(empty[1])) == (0.0, 0.0)
    counted = np.asarray(batch["targets_segmentation"][0]) != 0
    assert float(total_weights) == counted.sum() == DOC1 + DOC2 - 2
    per_token = []
    for lo, hi in ((0, DOC1), (DOC1, DOC1 + DOC2)):
        alone = _apply(kernel, variables, batch["inputs"][:, lo:hi])[0]
        ce = _cross_entropy64(alone, batch["targets"][0, lo:hi])
        per_token.append(ce[counted[lo:hi]])
    want = np.concatenate(per_token).sum() / counted.sum()
    np.testing.assert_allclose(float(loss), want, rtol=LOSS_RTOL)


# Tiled (the weights split with the tiles); the untiled weighted path is the packed test's.
@pytest.mark.parametrize("tiles", [4])
def test_weighted_loss_and_gradient_equal_the_explicit_reference(variables, tiles):
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, L), 0, CFG.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    weights = (jax.random.uniform(jax.random.PRNGKey(3), (2, L)) < 0.6).astype(jnp.float32)
    model = _model("dot_product", num_vocab_tiling=tiles)
    params = variables["params"]

    def ours(p):
        return model.apply({"params": p}, tokens, targets, method="loss", loss_weights_BxL=weights)

    def reference(p):
        logits = model.apply({"params": p}, tokens)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return (ce * weights).sum() / weights.sum()

    (loss, total_weights), grads = jax.jit(jax.value_and_grad(ours, has_aux=True))(params)
    want, want_grads = jax.jit(jax.value_and_grad(reference))(params)
    assert float(total_weights) == float(weights.sum()) < weights.size
    np.testing.assert_allclose(float(loss), float(want), rtol=LOSS_RTOL)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=0, atol=ELEMENT_TOL * float(jnp.abs(w).max()) + 1e-12)
    # The unweighted mean is something else, far outside the tolerance: the weights were not ignored.
    unweighted = optax.softmax_cross_entropy_with_integer_labels(
        _apply("dot_product", variables, tokens), targets).mean()
    assert abs(float(unweighted) - float(loss)) > 100 * LOSS_RTOL * float(loss)


def test_a_batch_with_some_document_keys_but_not_all_is_refused():
    batch = _packed_row()
    del batch["inputs_position"]
    with pytest.raises(ValueError, match=r"must also hold \['inputs_position'\]"):
        document_inputs(batch)
    assert document_inputs({"inputs": 0, "targets": 0}) == {}


def _uneven_batch(B=8):
    """B rows with 2, 4, ..., 2B counted targets: per-row means differ from the global mean."""
    tokens = jax.random.randint(jax.random.PRNGKey(4), (B, L), 1, CFG.vocab_size)
    counted_per_row = np.arange(1, B + 1) * 2
    target_seg = (np.arange(L)[None] < counted_per_row[:, None]).astype(np.int32)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1),
             "inputs_segmentation": jnp.ones((B, L), jnp.int32),
             "inputs_position": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
             "targets_segmentation": jnp.asarray(target_seg)}
    return batch, target_seg


def _global_reference(variables, batch, target_seg):
    ce = _cross_entropy64(_apply("dot_product", variables, batch["inputs"]), batch["targets"]) * target_seg
    return ce.sum() / target_seg.sum(), np.mean(ce.sum(1) / target_seg.sum(1))


def test_the_loss_divides_by_the_count_of_counted_tokens_in_the_whole_batch(variables):
    batch, target_seg = _uneven_batch()
    model = _model("dot_product")
    loss, total_weights = jax.jit(lambda b: model.apply(
        variables, b["inputs"], b["targets"], method="loss", **document_inputs(b)))(batch)
    want, mean_of_row_means = _global_reference(variables, batch, target_seg)
    assert float(total_weights) == target_seg.sum()
    np.testing.assert_allclose(float(loss), want, rtol=LOSS_RTOL)
    assert abs(mean_of_row_means - want) > 100 * LOSS_RTOL * want


@pytest.mark.slow  # two train-step compiles
def test_train_step_on_eight_devices_divides_by_the_global_count(variables):
    # One row per device, each with its own number of counted targets: the sharded step's loss
    # and gradient are the one-device step's (the global sum over the global count), not a mean
    # of per-device means.
    batch, target_seg = _uneven_batch()
    model = _model("dot_product")
    state = TrainState(step=jnp.zeros((), jnp.int32), params=variables["params"],
                       opt_state=optax.sgd(0.1).init(variables["params"]), fp8_meta={},
                       rng=jax.random.PRNGKey(0))
    step = jax.jit(make_train_step(model, optax.sgd(0.1)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data", None)))
    _, metrics = step(state, sharded)
    _, metrics_one = step(state, batch)
    want, _ = _global_reference(variables, batch, target_seg)
    assert float(metrics["total_weights"]) == target_seg.sum()
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=LOSS_RTOL)
    # (A mean of per-device means instead is off by ~0.1 here: the previous test's mean_of_row_means.)
    np.testing.assert_allclose(float(metrics["loss"]), float(metrics_one["loss"]), rtol=LOSS_RTOL)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(metrics_one["grad_norm"]), rtol=LOSS_RTOL)
