"""The update contract: what a site sends, compression with error feedback, bytes."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nvfp4_jax.federated import contract as C
from nvfp4_jax.quant import dequantize, quantize_nvfp4


def _update(seed, scale=1e-3):
    rng = np.random.default_rng(seed)
    return {"layers_0/mlp/gate/kernel": (rng.standard_normal((48, 32)) * scale).astype(np.float32),
            "final_norm/scale": (rng.standard_normal((7,)) * scale).astype(np.float32)}


@pytest.mark.parametrize("compression", ["fp8", "nvfp4"])
def test_error_feedback_sent_plus_residual_is_the_true_update(compression):
    residual = None
    sent_total = {k: np.zeros_like(v, np.float64) for k, v in _update(0).items()}
    true_total = {k: np.zeros_like(v, np.float64) for k, v in _update(0).items()}
    slack = {k: 0.0 for k in sent_total}
    for r in range(4):
        update = _update(r)
        previous = residual or {k: np.zeros_like(v) for k, v in update.items()}
        payload, shapes, residual = C.encode(update, compression, residual)
        decoded = C.decode(payload, compression, shapes)
        for k in update:
            # The kept residual is exactly what was not transmitted (one fp32 rounding at most).
            target = update[k] + previous[k]
            atol = float(np.max(np.spacing(np.abs(target))))
            np.testing.assert_allclose(decoded[k] + residual[k], target, rtol=0, atol=atol)
            slack[k] += atol
            sent_total[k] += decoded[k]
            true_total[k] += update[k]
    # Over the rounds the transmissions add up to the training, less the one residual still kept:
    # the sums telescope, so they differ by the rounds' fp32 roundings above (plus the float64
    # sums' own, negligible at 2**-50 of these magnitudes).
    for k in sent_total:
        bound = slack[k] + 2.0**-50 * float(np.abs(true_total[k]).max() + np.abs(sent_total[k]).max())
        np.testing.assert_allclose(sent_total[k] + residual[k], true_total[k], rtol=0, atol=bound)
        assert np.max(np.abs(residual[k])) < 0.2 * np.max(np.abs(true_total[k]))


def test_nvfp4_payload_is_the_projects_quantizer_and_its_bytes():
    update = _update(1)
    payload, shapes, _ = C.encode(update, "nvfp4")
    decoded = C.decode(payload, "nvfp4", shapes)
    x = update["layers_0/mlp/gate/kernel"].reshape(-1, 16)
    reference = np.asarray(dequantize(quantize_nvfp4(jnp.asarray(x)))).reshape(48, 32)
    assert np.array_equal(decoded["layers_0/mlp/gate/kernel"].view(np.uint32), reference.view(np.uint32))
    # 1536 values: 768 bytes of codes + 96 E4M3 scales + a 4-byte amax; 7 values pad to 16.
    assert C.payload_bytes(payload) == (768 + 96 + 4) + (8 + 1 + 4)


def test_fp8_payload_and_its_bytes():
    update = _update(2)
    payload, shapes, _ = C.encode(update, "fp8")
    x = update["final_norm/scale"]
    scale = np.float32(448.0 / np.max(np.abs(x)))
    expect = (x * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(1 / scale)
    np.testing.assert_array_equal(C.decode(payload, "fp8", shapes)["final_norm/scale"], expect)
    assert C.payload_bytes(payload) == (1536 + 4) + (7 + 4)
    assert C.payload_bytes(C.encode(update, "none")[0]) == 4 * (1536 + 7)


def test_trainable_subsets():
    paths = ["embed/embedding", "layers_0/attention/query/kernel", "layers_0/mlp/up/kernel",
             "layers_1/mlp/up/kernel", "layers_1/mlp_norm/scale", "final_norm/scale"]
    mlp = C.UpdateContract(kind="subset", trainable="mlp")
    assert C.trainable_paths(mlp, paths, 2) == ["layers_0/mlp/up/kernel", "layers_1/mlp/up/kernel"]
    last = C.UpdateContract(kind="subset", trainable="last:1")
    assert C.trainable_paths(last, paths, 2) == ["layers_1/mlp/up/kernel", "layers_1/mlp_norm/scale"]
    assert C.trainable_paths(C.UpdateContract(), paths, 2) == paths
    with pytest.raises(ValueError, match="selects no parameter"):
        C.trainable_paths(C.UpdateContract(kind="subset", trainable="^lm_head"), paths, 2)


@pytest.mark.parametrize("contract, message", [
    (C.UpdateContract(kind="weights"), "update='weights'"),
    (C.UpdateContract(compression="int4"), "compression='int4'"),
    (C.UpdateContract(kind="full", compression="nvfp4"), "compresses differences"),
    (C.UpdateContract(kind="diff", trainable="mlp"), "needs update=subset"),
    (C.UpdateContract(kind="subset"), "needs trainable="),
    (C.UpdateContract(kind="subset", trainable="last:0"), "positive integer"),
    (C.UpdateContract(kind="subset", trainable="(["), "not a valid regular expression"),
])
def test_bad_contracts(contract, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        C.check_contract(contract)
