"""Backend selection and the errors of the lazy Transformer Engine backend (no TE, no GPU here)."""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import jax
import pytest

from nvfp4_jax.quant import te_backend
from nvfp4_jax.quant.recipe import get_recipe
from nvfp4_jax.quant.te_backend import TEUnavailableError, resolve_backend


def _with_backend(flag, backend):
    return dataclasses.replace(get_recipe(flag), backend=backend)


def test_te_is_not_imported_by_the_package():
    # In a fresh interpreter (this one may have imported TE for other tests, e.g. in the GPU
    # container): importing the package and building an emulated model must not load TE.
    code = (
        "import sys\n"
        "import nvfp4_jax.quant, nvfp4_jax.train.build, nvfp4_jax.model\n"
        "from nvfp4_jax.quant import make_dot_general\n"
        "make_dot_general('nvfp4_no_sr')\n"
        "sys.exit(3 if 'transformer_engine' in sys.modules else 0)\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_auto_picks_te_only_with_te_and_blackwell():
    r = get_recipe("te_nvfp4")
    assert resolve_backend(r, te_ok=True, blackwell=True) == "te"
    assert resolve_backend(r, te_ok=True, blackwell=False) == "emulated"
    assert resolve_backend(r, te_ok=False, blackwell=True) == "emulated"
    # TE has no MXFP4 recipe: auto falls back to emulation even on Blackwell.
    assert resolve_backend(get_recipe("mxfp4"), te_ok=True, blackwell=True) == "emulated"
    assert resolve_backend(get_recipe("bf16"), te_ok=True, blackwell=True) == "emulated"


def test_probes_report_what_is_installed():
    # The probes against independent evidence: TE's distribution metadata and JAX's devices.
    # (Here: no TE, CPU only. In the GPU container: TE installed, and Blackwell or not.)
    te_installed = importlib.util.find_spec("transformer_engine") is not None
    if not te_installed:
        assert not te_backend.te_available()
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    blackwell = any(str(getattr(d, "compute_capability", "")).startswith("10.") for d in gpus)
    assert te_backend.device_is_blackwell() == blackwell
    want = "te" if te_backend.te_available() and blackwell else "emulated"
    assert resolve_backend(get_recipe("te_nvfp4")) == want


def test_emulated_never_touches_te():
    r = _with_backend("te_nvfp4", "emulated")
    assert resolve_backend(r, te_ok=True, blackwell=True) == "emulated"


def test_backend_te_without_te_says_what_is_missing():
    with pytest.raises(TEUnavailableError) as err:
        resolve_backend(_with_backend("te_nvfp4", "te"))
    msg = str(err.value)
    assert "transformer_engine.jax" in msg and "docker/" in msg and "backend='emulated'" in msg
    assert isinstance(err.value, ImportError)


def test_backend_te_for_a_recipe_te_lacks():
    with pytest.raises(ValueError, match="no Transformer Engine recipe for mxfp4"):
        resolve_backend(_with_backend("mxfp4", "te"), te_ok=True)


def test_make_dot_general_backend_te_without_te():
    from nvfp4_jax.quant.dot import make_dot_general

    with pytest.raises(TEUnavailableError, match="docker/"):
        make_dot_general(_with_backend("te_nvfp4", "te"), jax.random.PRNGKey(0))


def test_flax_module_backend_te_without_te():
    import jax.numpy as jnp

    from nvfp4_jax.quant.flax_dot import QuantDotGeneral

    mod = QuantDotGeneral(recipe=_with_backend("te_fp8_currentscaling", "te"))
    x, w = jnp.ones((16, 16)), jnp.ones((16, 16))
    with pytest.raises(TEUnavailableError, match="transformer_engine"):
        mod.init(jax.random.PRNGKey(0), x, w, (((1,), (0,)), ((), ())))


class _FakeDevice:
    def __init__(self, platform, cc):
        self.platform, self.compute_capability = platform, cc


def test_blackwell_probe():
    assert te_backend.device_is_blackwell([_FakeDevice("gpu", "10.0")])
    assert te_backend.device_is_blackwell([_FakeDevice("gpu", "10.3")])
    assert not te_backend.device_is_blackwell([_FakeDevice("gpu", "9.0")])
    assert not te_backend.device_is_blackwell([_FakeDevice("gpu", "12.0")])
    assert not te_backend.device_is_blackwell([_FakeDevice("cpu", None)])


# --- with a stand-in for TE's public API: our side of the contract ------------------------------


@pytest.fixture
def fake_te(monkeypatch):
    """Minimal modules with TE's public names: recipe classes and make_dot_general_cls."""
    import enum
    import types

    import flax.linen as nn

    class Format(enum.Enum):
        E2M1, E4M3, E5M2, HYBRID = range(4)

    @dataclasses.dataclass
    class NVFP4BlockScaling:
        disable_rht: bool = False
        disable_stochastic_rounding: bool = False
        disable_2d_quantization: bool = False

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"

    @dataclasses.dataclass
    class Float8CurrentScaling:
        fp8_format: Format = Format.HYBRID

    made = []

    def make_dot_general_cls(recipe):
        made.append(recipe)

        class TEDot(nn.Module):
            @nn.compact
            def __call__(self, lhs, rhs, dims, precision=None):
                self.make_rng(te_backend.TE_RNG_STREAM)
                return jax.lax.dot_general(lhs, rhs, dims) * 0 - 1  # recognisable output

        return TEDot

    recipe_mod = types.SimpleNamespace(
        Format=Format, NVFP4BlockScaling=NVFP4BlockScaling, DelayedScaling=DelayedScaling,
        Float8CurrentScaling=Float8CurrentScaling,
    )
    flax_mod = types.SimpleNamespace(make_dot_general_cls=make_dot_general_cls)
    monkeypatch.setattr(te_backend, "_import_te", lambda: (types.SimpleNamespace(), flax_mod, recipe_mod))
    return types.SimpleNamespace(made=made, recipe=recipe_mod)


def test_te_recipe_mapping(fake_te):
    r = fake_te.recipe
    assert te_backend.te_recipe(get_recipe("te_nvfp4")) == r.NVFP4BlockScaling(False, False, False)
    assert te_backend.te_recipe(get_recipe("te_nvfp4_no_rht")) == r.NVFP4BlockScaling(disable_rht=True)
    assert te_backend.te_recipe(get_recipe("nvfp4_no_sr")) == r.NVFP4BlockScaling(
        disable_stochastic_rounding=True
    )
    assert te_backend.te_recipe(get_recipe("nvfp4_1d_weights")) == r.NVFP4BlockScaling(
        disable_2d_quantization=True
    )
    assert te_backend.te_recipe(get_recipe("te_fp8_delayedscaling")) == r.DelayedScaling(
        margin=0, fp8_format=r.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max"
    )
    assert te_backend.te_recipe(get_recipe("te_fp8_currentscaling")) == r.Float8CurrentScaling(
        fp8_format=r.Format.HYBRID
    )


def test_flax_module_delegates_to_te(fake_te, monkeypatch):
    import jax.numpy as jnp

    from nvfp4_jax.quant.flax_dot import QuantDotGeneral, quant_rngs

    mod = QuantDotGeneral(recipe=_with_backend("te_nvfp4", "te"))
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    dims = (((1,), (0,)), ((), ()))
    key = jax.random.PRNGKey(1)
    variables = mod.init(quant_rngs(key), x, w, dims)
    y = mod.apply(variables, x, w, dims, rngs=quant_rngs(key))
    assert (y == -1).all()
    assert fake_te.made == [fake_te.recipe.NVFP4BlockScaling()] * 2
