"""The stochastic-rounding noise (`formats.stochastic_rounding_bits`): Threefry-2x32 of each
8-element group's index, checked against the cipher's published test vectors and JAX's own
implementation, and as a distribution (uniform bytes, no correlation between neighbours)."""

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.quant import formats as F

# Known-answer vectors of Threefry-2x32 with 20 rounds (Random123, kat_vectors): key, counter,
# output, all as (word 0, word 1).
THREEFRY_KAT = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("key,counter,want", THREEFRY_KAT)
def test_threefry_known_answers(key, counter, want):
    got = F.threefry2x32(*(jnp.uint32(v) for v in key + counter))
    assert tuple(int(v) for v in got) == want


def test_noise_is_threefry_of_the_group_index_little_endian():
    # Element i: byte i % 4 (low byte first) of word (i % 8) // 4 of threefry(key, (i // 8, 0)),
    # with JAX's own implementation of the cipher as the reference.
    key = jax.random.key(42)
    shape = (6, 40)  # 240 elements: 30 groups, groups straddle rows
    got = np.asarray(F.stochastic_rounding_bits(key, shape)).reshape(-1)
    groups = np.arange(30, dtype=np.uint32)
    words = np.asarray(jex_random.threefry_2x32(jax.random.key_data(key), np.concatenate([groups, 0 * groups])))
    want = np.stack([words[:30], words[30:]], axis=-1).astype("<u4").view(np.uint8).reshape(-1)
    np.testing.assert_array_equal(got, want)
    assert F.stochastic_rounding_bits(key, shape).dtype == jnp.uint8


def test_noise_depends_on_the_flat_index_only():
    key = jax.random.key(1)
    flat = np.asarray(F.stochastic_rounding_bits(key, (12 * 16,)))
    np.testing.assert_array_equal(np.asarray(F.stochastic_rounding_bits(key, (12, 16))).reshape(-1), flat)
    np.testing.assert_array_equal(np.asarray(F.stochastic_rounding_bits(key, (3, 4, 16))).reshape(-1), flat)
    # A size that is not a multiple of 8 is the prefix of a longer draw.
    np.testing.assert_array_equal(np.asarray(F.stochastic_rounding_bits(key, (13,))), flat[:13])


def test_raw_and_typed_keys_agree_and_other_keys_differ():
    typed = jax.random.key(5)
    raw = jax.random.key_data(typed)
    a = np.asarray(F.stochastic_rounding_bits(typed, (64, 64)))
    np.testing.assert_array_equal(a, np.asarray(F.stochastic_rounding_bits(raw, (64, 64))))
    b = np.asarray(F.stochastic_rounding_bits(jax.random.fold_in(typed, 1), (64, 64)))
    assert abs((a == b).mean() - 1 / 256) < 0.003
    rbg = jax.random.key(5, impl="rbg")  # another PRNG: its key is hashed to two words first
    c = np.asarray(F.stochastic_rounding_bits(rbg, (64, 64)))
    assert abs((a == c).mean() - 1 / 256) < 0.003
    with pytest.raises(ValueError, match="needs one PRNG key"):
        F.stochastic_rounding_bits(jnp.zeros((3,), jnp.uint32), (16,))


def test_bytes_are_uniform_and_independent():
    # 2**18 bytes: chi-square over 256 bins (255 dof: mean 255, sd 22.6; 350 is p ~ 1e-4), and
    # neighbouring bytes (same word, next word, next group) uncorrelated to within 4 sd.
    n = 2**18
    v = np.asarray(F.stochastic_rounding_bits(jax.random.key(9), (n,))).astype(np.float64)
    counts = np.bincount(v.astype(np.int64), minlength=256)
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
    assert chi2 < 350, chi2
    for lag in (1, 4, 8):
        r = np.corrcoef(v[:-lag], v[lag:])[0, 1]
        assert abs(r) < 4 / np.sqrt(n), (lag, r)


def test_too_many_elements_is_an_error():
    with pytest.raises(ValueError, match="at most 34359738368 elements"):
        F.stochastic_rounding_bits(jax.random.key(0), (2**20, 2**16))


@pytest.mark.parametrize("jit", [False, True])
def test_the_pass_wide_draws_equal_one_draw_per_tensor(jit):
    """The quantizer's one-call forms are bit for bit the per-tensor ones they replace: `sr_keys`
    is `fold_in(key, 0), fold_in(key, 1)` (raw, typed threefry and typed rbg keys), and
    `stochastic_rounding_bits_group` each tensor's own `stochastic_rounding_bits`, whatever the
    sizes (a tensor that ends mid-group before the next one). A grouped draw that shifted
    a tensor's counters, swapped its key words or dropped its tail would differ."""
    from nvfp4_jax.quant.nvfp4_backend import sr_keys

    wrap = jax.jit if jit else (lambda f: f)
    for key in (jax.random.PRNGKey(3), jax.random.key(7), jax.random.key(7, impl="rbg")):
        data = jax.random.key_data if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else np.asarray
        got = wrap(sr_keys)(key)
        for k, d in zip(got, (0, 1)):
            np.testing.assert_array_equal(data(k), data(jax.random.fold_in(key, d)))
    keys = [jax.random.PRNGKey(1), jax.random.key(2), jax.random.PRNGKey(9)]
    shapes = [(5, 3), (32, 7), (3,)]  # 15 elements: a partial group before the next tensor
    grouped = wrap(lambda *ks: F.stochastic_rounding_bits_group(list(ks), shapes))(*keys)
    for key, shape, noise in zip(keys, shapes, grouped):
        np.testing.assert_array_equal(noise, F.stochastic_rounding_bits(key, shape))
