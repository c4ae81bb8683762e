"""The Transformer Engine backend (no TE, no GPU here): its errors, and our side of TE's public API
run against a fake TE module that has TE's names and asserts what real TE asserts."""

import contextlib
import dataclasses
import enum
import importlib.util
import inspect
import os
import subprocess
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.config import ConfigError, load_config
from nvfp4_jax.quant import TE, QuantDotGeneral, choose_backend, make_dot_general, quant_rngs, te_backend
from nvfp4_jax.quant.recipe import get_recipe
from nvfp4_jax.quant.te_backend import TEUnavailableError

DIMS = (((1,), (0,)), ((), ()))


def test_te_is_not_imported_by_the_package():
    # In a fresh interpreter (this one may have imported TE for other tests, e.g. in the GPU
    # container): importing the package, choosing the backend and building a model must not load TE.
    code = (
        "import sys\n"
        "import nvfp4_jax.quant, nvfp4_jax.train.build, nvfp4_jax.model\n"
        "from nvfp4_jax.config import load_config\n"
        "from nvfp4_jax.quant import get_recipe, make_dot_general\n"
        "make_dot_general(get_recipe('nvfp4_no_sr'))\n"
        "nvfp4_jax.train.build.build_model(load_config(['quantization=te_nvfp4']).model)\n"
        "sys.exit(3 if 'transformer_engine' in sys.modules else 0)\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_probes_report_what_is_installed():
    # The probes against independent evidence: TE's distribution metadata and JAX's devices.
    if importlib.util.find_spec("transformer_engine") is None:
        assert not te_backend.te_available()
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    blackwell = any(str(getattr(d, "compute_capability", "")).startswith("10.") for d in gpus)
    assert te_backend.device_is_blackwell() == blackwell


class _FakeDevice:
    def __init__(self, platform, cc):
        self.platform, self.compute_capability = platform, cc


def test_blackwell_probe():
    assert te_backend.device_is_blackwell([_FakeDevice("gpu", "10.0")])
    assert te_backend.device_is_blackwell([_FakeDevice("gpu", "10.3")])
    assert not te_backend.device_is_blackwell([_FakeDevice("gpu", "9.0")])
    assert not te_backend.device_is_blackwell([_FakeDevice("gpu", "12.0")])
    assert not te_backend.device_is_blackwell([_FakeDevice("cpu", None)])


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE installed")
def test_te_without_te_says_what_is_missing():
    with pytest.raises(TEUnavailableError) as err:
        te_backend.check_te(get_recipe("te_nvfp4"))
    msg = str(err.value)
    assert "transformer_engine.jax" in msg and "docker/" in msg
    assert "quantization_backend=emulated" in msg and "quantization_backend=xla" in msg
    assert isinstance(err.value, ImportError)
    assert te_backend.te_unavailable_reason(get_recipe("te_nvfp4")) == msg
    # The run's entry point turns it into a config error before anything compiles.
    from nvfp4_jax.train.build import quantization_backend

    with pytest.raises(ConfigError, match="transformer_engine.jax"):
        quantization_backend(load_config(["quantization=te_nvfp4", "quantization_backend=te"]).model)


def test_make_dot_general_takes_no_te_backend():
    with pytest.raises(ValueError, match="QuantDotGeneral"):
        make_dot_general(get_recipe("te_nvfp4"), jax.random.PRNGKey(0), backend=TE)


# --- with a stand-in for TE's public API: our side of the contract ------------------------------


class FakeTE:
    """TE's public names (recipes, make_dot_general_cls, get_quantize_config_with_recipe,
    MeshResource, global_shard_guard), with TE's own assertions: the GEMM needs a global
    MeshResource, NVFP4 with SR draws from the rng stream "sr_rng", and the output is bf16."""

    def __init__(self, version="2.14.0", has_dot_general_cls=True, supported=(True, None)):
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

        @dataclasses.dataclass
        class MeshResource:
            dp_resource: str = None
            tp_resource: str = None
            fsdp_resource: str = None

        self.recipe = types.SimpleNamespace(
            Format=Format, NVFP4BlockScaling=NVFP4BlockScaling, DelayedScaling=DelayedScaling,
            Float8CurrentScaling=Float8CurrentScaling,
        )
        self.mesh_resource = None
        self.made, self.support_asked, self.calls = [], [], []
        fake = self

        @contextlib.contextmanager
        def global_shard_guard(resource):
            old, fake.mesh_resource = fake.mesh_resource, resource
            try:
                yield
            finally:
                fake.mesh_resource = old

        def make_dot_general_cls(recipe):
            fake.made.append(recipe)

            class TEDot(nn.Module):
                @nn.compact
                def __call__(self, lhs, rhs, dims, precision=None):
                    assert fake.mesh_resource is not None, "Global mesh resource is not set."
                    if isinstance(recipe, NVFP4BlockScaling) and not recipe.disable_stochastic_rounding:
                        self.make_rng(te_backend.TE_RNG_STREAM)
                    fake.calls.append(fake.mesh_resource)
                    y = jax.lax.dot_general(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), dims)
                    return y * 0 - 1  # recognisable output, in TE's dtype

            return TEDot

        class QuantizeConfig:
            def __init__(self, recipe):
                fake.support_asked.append(recipe)

            def is_supported(self):
                return supported

        flax_names = dict(make_dot_general_cls=make_dot_general_cls) if has_dot_general_cls else {}
        self.modules = {
            "root": types.SimpleNamespace(__version__=version),
            "te": types.SimpleNamespace(),
            "flax": types.SimpleNamespace(**flax_names),
            "recipe": self.recipe,
            "quantize": types.SimpleNamespace(get_quantize_config_with_recipe=QuantizeConfig),
            "sharding": types.SimpleNamespace(MeshResource=MeshResource, global_shard_guard=global_shard_guard),
        }
        self.MeshResource = MeshResource


@pytest.fixture
def fake_te(monkeypatch):
    def install(**kw):
        fake = FakeTE(**kw)
        monkeypatch.setattr(te_backend, "_import_te", lambda: fake.modules)
        return fake

    return install


def _scope():
    return te_backend.mesh_resource_scope(dp_axis="data", fsdp_axis="fsdp")


def test_te_recipe_mapping(fake_te):
    r = fake_te().recipe
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


def test_te_2_20_environment_options_are_pinned(fake_te):
    """TE 2.20's recipe classes read more options from NVTE_* environment variables at class
    definition (4-over-6 block scaling, row-scaled activations, a high-precision backward), each
    a change of numerics: our recipe objects pin them to the standard recipe, whatever the
    shell said. The fake's defaults play a shell that set them all (TE 2.20's field names)."""
    r = fake_te().recipe

    @dataclasses.dataclass
    class NVFP4BlockScaling:  # TE 2.20's fields, with the defaults a user's shell can set
        disable_rht: bool = True
        disable_stochastic_rounding: bool = True
        disable_2d_quantization: bool = True
        row_scaled_activation: bool = True
        nvfp4_4over6: str = "all"
        backward_override: str = "high_precision"

    @dataclasses.dataclass
    class Float8CurrentScaling:
        fp8_format: r.Format = r.Format.E4M3
        backward_override: str = "dequantized"

    r.NVFP4BlockScaling, r.Float8CurrentScaling = NVFP4BlockScaling, Float8CurrentScaling
    assert te_backend.te_recipe(get_recipe("te_nvfp4")) == NVFP4BlockScaling(
        False, False, False, row_scaled_activation=False, nvfp4_4over6="none", backward_override=None)
    assert te_backend.te_recipe(get_recipe("te_fp8_currentscaling")) == Float8CurrentScaling(
        fp8_format=r.Format.HYBRID, backward_override=None)
    # A TE without those fields (2.14) gets none of them (it would reject unknown arguments).
    assert te_backend.te_recipe(get_recipe("te_fp8_delayedscaling")) == r.DelayedScaling(
        margin=0, fp8_format=r.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max")


@pytest.mark.parametrize("flag", ["mxfp4", "mxfp4_nvfp4_recipe"])
def test_te_has_no_mxfp4(fake_te, flag):
    fake_te()
    with pytest.raises(ValueError, match=f"no Transformer Engine recipe for {flag} "):
        te_backend.check_te(get_recipe(flag))


def test_te_older_than_2_12_is_a_clear_error(fake_te):
    fake_te(version="2.11.0", has_dot_general_cls=False)
    with pytest.raises(TEUnavailableError, match=r"2\.11\.0 lacks .*make_dot_general_cls \(added in TE 2\.12\)"):
        te_backend.check_te(get_recipe("te_nvfp4"))


def test_te_support_test_is_asked_for_this_recipe(fake_te):
    fake = fake_te(supported=(False, "NVFP4 requires compute capability >= 100, got 90"))
    with pytest.raises(TEUnavailableError, match="te_nvfp4_no_rht on these devices: NVFP4 requires"):
        te_backend.check_te(get_recipe("te_nvfp4_no_rht"))
    assert fake.support_asked == [fake.recipe.NVFP4BlockScaling(disable_rht=True)]
    reason = te_backend.te_unavailable_reason(get_recipe("te_nvfp4_no_rht"))
    assert "compute capability >= 100" in reason
    # ... and so is the explicit choice at start-up, and a traced module.
    with pytest.raises(TEUnavailableError, match="compute capability"):
        choose_backend("te", get_recipe("te_nvfp4_no_rht"))
    mod = QuantDotGeneral(recipe=get_recipe("te_nvfp4_no_rht"), nvfp4_backend=TE)
    with _scope(), pytest.raises(TEUnavailableError, match="compute capability"):
        mod.init(quant_rngs(jax.random.PRNGKey(0)), jnp.ones((16, 32)), jnp.ones((32, 16)), DIMS)


def test_te_choice_names_the_version(fake_te):
    fake_te(version="2.14.1")
    choice = choose_backend("te", get_recipe("te_nvfp4"))
    assert choice.name == "te" and "Transformer Engine 2.14.1 runs te_nvfp4" in choice.line
    assert te_backend.te_unavailable_reason(get_recipe("te_nvfp4")) is None


def test_mesh_resource_scope_sets_and_restores(fake_te):
    fake = fake_te()
    assert fake.mesh_resource is None
    with _scope():
        assert fake.mesh_resource == fake.MeshResource(dp_resource="data", fsdp_resource="fsdp")
    assert fake.mesh_resource is None


@pytest.mark.parametrize("preferred, want", [(jnp.float32, jnp.float32), (None, jnp.float32)])
def test_flax_module_delegates_to_te_and_casts_its_output(fake_te, preferred, want):
    fake = fake_te()
    mod = QuantDotGeneral(recipe=get_recipe("te_nvfp4"), nvfp4_backend=TE)
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    key = jax.random.PRNGKey(1)
    with _scope():
        variables = mod.init(quant_rngs(key), x, w, DIMS)
        y = mod.apply(variables, x, w, DIMS, preferred_element_type=preferred, rngs=quant_rngs(key))
    assert (np.asarray(y) == -1).all() and y.dtype == want  # the fake returns bf16
    assert fake.made == [fake.recipe.NVFP4BlockScaling()] * 2
    with pytest.raises(AssertionError, match="Global mesh resource is not set"):  # the fake bites
        mod.apply(variables, x, w, DIMS, rngs=quant_rngs(key))


@pytest.mark.slow
def test_init_train_and_eval_run_under_tes_mesh_resource(fake_te):
    """build.py enters TE's MeshResource around init, the train step and the eval step, and init
    provides TE's rng stream: the fake TE asserts both, as real TE does."""
    from nvfp4_jax.quant import Backend
    from nvfp4_jax.sharding import make_mesh
    from nvfp4_jax.train.build import build_model, init_state, jit_eval_step, jit_train_step
    from nvfp4_jax.train.optimizer import make_optimizer

    fake = fake_te()
    cfg = load_config(["model_name=tiny", "base_num_decoder_layers=1", "max_target_length=16",
                       "quantization=te_nvfp4", "quantization_backend=te"])
    model = build_model(cfg.model, backend=Backend("te", "test", TE))
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    optimizer = make_optimizer(cfg.train)
    state, state_sh = init_state(model, optimizer, 16, mesh, 0)
    tokens = jnp.zeros((2, 16), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    state, metrics = jit_train_step(model, optimizer, mesh, state_sh)(state, batch)
    loss = jit_eval_step(model, mesh, state_sh)(state, batch)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(loss))
    assert fake.calls and all(r == fake.MeshResource(dp_resource="data", fsdp_resource="fsdp") for r in fake.calls)
    assert fake.mesh_resource is None  # and nothing leaks out of the steps
    with pytest.raises(AssertionError, match="Global mesh resource"):  # without build's scope
        model.init({"params": jax.random.PRNGKey(0), **quant_rngs(jax.random.PRNGKey(1))}, tokens)


# --- the fake against real TE, where TE is importable (the GPU container) ----------------------


def _fake_vs_real(fake_modules, real_modules) -> list[str]:
    """What the fake has that the real TE modules lack or spell differently: every name, every
    recipe field (and its default), every Format member, and every call the fake accepts must
    be accepted by TE's own signature."""
    problems = []
    for part, ns in fake_modules.items():
        for name, obj in vars(ns).items():
            if name.startswith("__"):
                continue
            if not hasattr(real_modules[part], name):
                problems.append(f"{part}.{name} missing")
                continue
            real = getattr(real_modules[part], name)
            if isinstance(obj, type) and issubclass(obj, enum.Enum):
                problems += [f"{part}.{name}.{m.name} missing" for m in obj if not hasattr(real, m.name)]
            elif dataclasses.is_dataclass(obj):
                params = inspect.signature(real).parameters
                for field in dataclasses.fields(obj):
                    if field.name not in params:
                        problems.append(f"{part}.{name}({field.name}=) not accepted")
                        continue
                    got, want = params[field.name].default, field.default
                    if got is not inspect.Parameter.empty and getattr(got, "name", got) != getattr(want, "name", want):
                        problems.append(f"{part}.{name}.{field.name} defaults to {got!r}, the fake to {want!r}")
            elif callable(obj):
                required = [p for p in inspect.signature(obj).parameters.values()
                            if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
                try:
                    inspect.signature(real).bind(*[None] * len(required))
                except TypeError as exc:
                    problems.append(f"{part}.{name}({len(required)} positional): {exc}")
    return problems


def test_fake_vs_real_comparison_finds_a_renamed_field_and_a_missing_name():
    fake, other = FakeTE(), FakeTE()
    assert _fake_vs_real(fake.modules, other.modules) == []
    renamed = dataclasses.make_dataclass("NVFP4BlockScaling", [("disable_rht", bool, False),
                                                               ("disable_sr", bool, False),
                                                               ("disable_2d_quantization", bool, False)])
    other.modules["recipe"] = types.SimpleNamespace(**dict(vars(other.recipe), NVFP4BlockScaling=renamed))
    del other.modules["sharding"].global_shard_guard
    assert _fake_vs_real(fake.modules, other.modules) == [
        "recipe.NVFP4BlockScaling(disable_stochastic_rounding=) not accepted",
        "sharding.global_shard_guard missing",
    ]


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="Transformer Engine is not installed (the GPU container has it)")
def test_the_fake_has_real_tes_names_fields_and_signatures():
    assert _fake_vs_real(FakeTE().modules, te_backend._import_te()) == []
