"""The kernels behind the reference's signatures (`nvfp4_jax.kernels.operand`), and the kernels
as Triton sees them. The numerics are pinned in test_quantize.py; here: which calls reach the
kernels, in which shapes, with the reference's results and errors, and that every kernel lowers
to Triton for a GPU (checked on CPU: lowering needs no GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend_arithmetic import faithful_division
from bitwise import assert_same_bits
from jax.experimental import pallas as pl

from nvfp4_jax import kernels
from nvfp4_jax.kernels import Copy, fused_quantize
from nvfp4_jax.kernels.operand import kernel_copy
from nvfp4_jax.nvfp4_spec import spread_data
from nvfp4_jax.quant.spec import OperandSpec
from nvfp4_jax.quant import nvfp4_gemm_operand, quantize_nvfp4

KEYS = jax.random.split(jax.random.key(11), 2)


@pytest.mark.parametrize("shape,kw,blocks", [
    ((64, 32), dict(axis=1), "rows"),
    ((4, 16, 32), dict(axis=-1), "rows"),  # leading dims flattened into rows
    ((64, 32), dict(axis=0, rht=True), "cols"),
    ((64, 32), dict(axis=0), "cols"),
    ((64, 32), dict(two_d=True, axis=0), "tiles"),  # two_d ignores axis, as the reference does
    ((64, 32), dict(axis=1, rht=True), None),  # the RHT along the last axis: the reference's
    ((24, 32), dict(axis=1), None),  # 24 rows: not a multiple of 16
    ((32, 24), dict(axis=0), None),  # N = 24
    ((4, 32, 16), dict(axis=1), None),  # a block axis in the middle
])
def test_which_calls_reach_the_kernels(shape, kw, blocks):
    args = dict(dict(axis=-1, two_d=False, rht=False), **kw)
    axis = args["axis"] % len(shape)
    spec = OperandSpec(axis=axis, two_d=args["two_d"], rht=args["rht"], stochastic=True)
    copy = kernel_copy(shape, spec, packed=False)
    assert (copy.blocks if copy else None) == blocks
    if copy:
        assert copy.rht == args["rht"] and copy.stochastic and not copy.packed


def test_wrappers_match_reference_in_nd_and_single_tile_shapes():
    # 3-D rows with SR (flattened, then restored: codes and scales in x's own shape), and a
    # tensor of one 16 x 16 tile (a 1 x 1 grid), both forms.
    for shape, kw in (((2, 16, 48), dict(stochastic=True, key=KEYS[0])), ((16, 16), dict(two_d=True))):
        x = jnp.asarray(spread_data(1, (int(np.prod(shape[:-1])), shape[-1])), jnp.bfloat16).reshape(shape)
        got, want = kernels.quantize_nvfp4(x, **kw, interpret=True), quantize_nvfp4(x, **kw)
        assert (got.shape, got.axis, got.two_d, got.rht) == (want.shape, want.axis, want.two_d, want.rht)
        assert_same_bits((got.codes, got.scales, got.amax), (want.codes, want.scales, want.amax), shape)
        assert_same_bits(kernels.gemm_operand(x, **kw, interpret=True), nvfp4_gemm_operand(x, **kw), shape)


def test_uncovered_arguments_fall_back_to_the_reference():
    x = jnp.asarray(spread_data(2, (24, 32)), jnp.float32)
    for kw in (dict(axis=-1, rht=True), dict(axis=1)):
        assert_same_bits(kernels.gemm_operand(x, **kw, interpret=True), nvfp4_gemm_operand(x, **kw), kw)


def test_pair_is_two_reference_operands_from_one_call():
    x = jnp.asarray(spread_data(3, (32, 48)), jnp.bfloat16)
    first = dict(axis=1, stochastic=True, key=KEYS[0])
    second = dict(axis=0, rht=True, stochastic=True, key=KEYS[1])
    fn = jax.jit(lambda x: kernels.gemm_operand_pair(x, first, second, interpret=True))
    assert_same_bits(fn(x), (nvfp4_gemm_operand(x, **first), nvfp4_gemm_operand(x, **second)))
    # One amax kernel and one quantize kernel for both copies.
    assert str(jax.make_jaxpr(fn)(x)).count("pallas_call") == 2


def test_bad_arguments_raise_the_references_errors():
    x = jnp.zeros((32, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="stochastic=True requires a PRNG key"):
        kernels.gemm_operand(x, stochastic=True)
    with pytest.raises(ValueError, match="must be a multiple of 16"):
        kernels.quantize_nvfp4(jnp.zeros((32, 24)))
    with pytest.raises(ValueError, match="only real floating dtypes"):
        kernels.gemm_operand(jnp.zeros((32, 32), jnp.int32))
    with pytest.raises(ValueError, match="rht=True needs blocks='cols'"):
        Copy("rows", rht=True)
    with pytest.raises(ValueError, match="blocks='diagonal'"):
        Copy("diagonal")
    with pytest.raises(ValueError, match="needs a key"):
        fused_quantize(x, [Copy("rows", stochastic=True)], [None], interpret=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        fused_quantize(jnp.zeros((32, 24)), [Copy("rows")], interpret=True)


# --- Triton ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("copies", [
    (Copy("rows", stochastic=True), Copy("cols", rht=True, stochastic=True)),  # dY's pair
    (Copy("rows"), Copy("tiles"), Copy("cols")),
    (Copy("rows", packed=True), Copy("tiles", packed=True), Copy("cols", rht=True, stochastic=True, packed=True)),
], ids=["dy-pair", "operands", "packed"])
def test_kernels_lower_to_triton(copies):
    # Lowering for CUDA runs the Pallas-to-Triton translation on any machine: every operation
    # in the kernels has a Triton lowering and every block shape is legal. (Compiling the
    # Triton module needs a GPU: nvfp4_jax/device_check.py.)
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    keys = [jax.ShapeDtypeStruct((), jax.random.key(0).dtype)] * len(copies)
    fn = jax.jit(lambda x, keys: fused_quantize(x, copies, [k if c.stochastic else None for c, k in zip(copies, keys)],
                                                interpret=False))
    with _abstract_gpu():
        text = fn.trace(x, keys).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2  # the amax kernel and the quantize kernel


def _abstract_gpu():
    """A context in which Pallas's Triton lowering may target a GPU that is not here. JAX >= 0.11
    asks the device for its compute capability and, without one, for an abstract GPU device on the
    abstract mesh (a B200 here: the kernels' target); JAX 0.10 needs nothing."""
    import contextlib

    from jax._src import mesh as mesh_lib  # AbstractDevice is not exported

    if not hasattr(mesh_lib, "AbstractDevice"):
        return contextlib.nullcontext()
    device = mesh_lib.AbstractDevice(device_kind="NVIDIA B200", num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


# --- the emulation really reaches inside interpreted kernels --------------------------------------


def _kernel_call(body, *args):
    def kernel(*refs):
        refs[-1][...] = body(*(r[...] for r in refs[:-1]))

    out = jax.ShapeDtypeStruct(args[0].shape, jnp.float32)
    return jax.jit(pl.pallas_call(kernel, out_shape=out, interpret=True))(*args)


def test_interpreter_sees_emulated_arithmetic():
    # Pallas's interpreter lowers a kernel's operations with JAX's lowering rules, which the
    # `arithmetic` fixture's emulation patches (division here; adds and subtracts likewise), so
    # test_quantize.py's bitwise tests under that fixture run the kernels with GPU-legal
    # arithmetic. (XLA:CPU already contracts multiply-adds inside a kernel's fused loop.)
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal(256), jnp.float32) for _ in range(2))
    exact_q = np.asarray(a) / np.asarray(b)
    np.testing.assert_array_equal(_kernel_call(lambda x, y: x / y, a, b), exact_q)
    with faithful_division():
        q = np.asarray(_kernel_call(lambda x, y: x / y, a, b))
    assert (q != exact_q).mean() > 0.2
