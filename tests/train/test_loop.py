"""End-to-end training: the loss falls as only a learning model's can, resume is exact and
guarded, damaged checkpoints are skipped, non-finite states are never saved."""

import dataclasses
import glob
import json
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _helpers import flip_bytes_in_largest_file, read_metrics
from nvfp4_jax import data as data_lib
from nvfp4_jax.config import load_config
from nvfp4_jax.sharding import batch_sharding, make_mesh
from nvfp4_jax.train import assembly, checkpoint, loop, run_lock
from nvfp4_jax.train.build import build_model, jit_train_step, state_shardings
from nvfp4_jax.train.loop import NonFiniteError, ResumeError, run
from nvfp4_jax.train.optimizer import make_optimizer
from nvfp4_jax.quant.xla_backend import probe_scaled_matmul

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Small enough for 2 CPU cores; same shapes in every test so compilations are few.
TINY = [
    "model_name=tiny", "base_num_decoder_layers=2", "max_target_length=64",
    "per_device_batch_size=8", "log_period=1", "eval_steps=1", "ici_fsdp_parallelism=1",
]


# The test session has 8 virtual devices (tests/conftest.py); these runs use one.
ONE_DEVICE = jax.devices()[:1]


def _config(tmp_path, *extra):
    return load_config(TINY + [f"base_output_directory={tmp_path}", "run_name=run", *extra])


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def _files(run_dir):
    """{relative path: bytes} of everything in a run directory."""
    out = {}
    for root, _, names in os.walk(run_dir):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, run_dir)] = f.read()
    return out


def _restore(cfg, step=None):
    """The checkpoint of `step` (default: latest) of a one-device run, verified."""
    mesh = make_mesh(cfg.mesh, ONE_DEVICE)
    abstract, _ = state_shardings(build_model(cfg.model), make_optimizer(cfg.train), cfg.model.max_target_length, mesh)
    manager = checkpoint.make_manager(os.path.join(loop.run_directory(cfg), "checkpoints"), max_to_keep=100)
    return checkpoint.restore(manager, abstract, step)


# --- the loss falls as only a learning model's can -------------------------------------------

LEARN = ("steps=40", "learning_rate=1e-2", "eval_interval=1000", "enable_checkpointing=false")


def _byte_unigram_entropy() -> float:
    """Nats per byte of the training split's byte frequencies: the loss of the best model that
    ignores context, which an untrained or merely counting model cannot beat."""
    train = data_lib.make_dataset(load_config(TINY).data, seq_len=64, global_batch_size=8, seed=0,
                                  split="train", vocab_size=256)
    start, stop = train.token_range
    p = np.bincount(train.tokens[start:stop], minlength=256) / (stop - start)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@pytest.fixture(scope="module")
def bf16_learning_run(tmp_path_factory):
    cfg = _config(tmp_path_factory.mktemp("bf16"), "quantization=bf16", *LEARN)
    summary = run(cfg, progress=False, devices=ONE_DEVICE)
    return summary, _losses(loop.run_directory(cfg))


@pytest.mark.slow
def test_bf16_learns_beyond_byte_statistics(bf16_learning_run):
    summary, losses = bf16_learning_run
    unigram = _byte_unigram_entropy()
    assert 3.2 < unigram < 3.5  # ~3.33 nats for this corpus
    assert summary["first_train_loss"] > 5.0  # ln(256) = 5.55 at init
    # Only a model using context gets well below the unigram entropy (measured: ~2.5 at step 40).
    assert np.mean([losses[s] for s in range(31, 41)]) < unigram - 0.5, summary
    assert summary["final_eval_loss"] < unigram - 0.5, summary


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["te_nvfp4", "te_fp8_delayedscaling"])
def test_quantized_runs_learn_like_bf16(tmp_path, quantization, bf16_learning_run):
    bf16_summary, bf16_losses = bf16_learning_run
    cfg = _config(tmp_path, f"quantization={quantization}", *LEARN)
    summary = run(cfg, progress=False, devices=ONE_DEVICE)
    losses = _losses(loop.run_directory(cfg))
    late = np.mean([losses[s] for s in range(31, 41)])
    # Measured: within 0.02 of bf16 over steps 31-40; a quantizer that broke learning would not be.
    assert late < np.mean([bf16_losses[s] for s in range(31, 41)]) + 0.1, (late, summary)
    assert summary["final_eval_loss"] < bf16_summary["final_eval_loss"] + 0.1, summary
    assert late < _byte_unigram_entropy() - 0.5


# --- resume ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_resume_falls_back_past_a_damaged_checkpoint_and_reproduces_the_losses(tmp_path, monkeypatch, capsys):
    args = ("quantization=te_nvfp4", "steps=6", "checkpoint_period=3", "eval_interval=1000")
    cfg = _config(tmp_path, *args)
    run(cfg, progress=False, devices=ONE_DEVICE)
    run_dir = loop.run_directory(cfg)
    full = _losses(run_dir)
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    flip_bytes_in_largest_file(os.path.join(run_dir, "checkpoints", "6", "state"))

    # With fallback off, the run stops before training and changes nothing.
    before = _files(run_dir)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 6 .*damaged.*checkpoint_fallback=false"):
        run(_config(tmp_path, *args, "checkpoint_fallback=false"), progress=False, devices=ONE_DEVICE)
    assert _files(run_dir) == before
    capsys.readouterr()

    # A resume restores onto the abstract state; it never builds a fresh one first.
    def no_fresh_state(*a, **k):
        raise AssertionError("init_state called on resume")

    monkeypatch.setattr(assembly.Run, "init_state", no_fresh_state)
    summary = run(cfg, progress=False, devices=ONE_DEVICE)
    out = capsys.readouterr()
    damaged = [line for line in out.err.splitlines() if "checkpoint step 6" in line and "is damaged" in line]
    assert len(damaged) == 1 and "falling back" in damaged[0], out.err
    assert "Resumed from checkpoint step 3" in out.out and "(verified;" in out.out
    rejected = os.listdir(os.path.join(run_dir, "rejected_checkpoints"))
    assert len(rejected) == 1 and rejected[0].startswith("6-")

    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # steps 4-6 of segment 0 were dropped
    assert [r["segment"] for r in records] == [0, 0, 0, 1, 1, 1]
    assert _losses(run_dir) == full  # bit-identical to the uninterrupted run
    # The summary covers the whole run, not only the resumed segment.
    assert summary["first_train_loss"] == full[1] and summary["final_train_loss"] == full[6]
    assert summary["resumed_from_step"] == 3 and summary["last_checkpoint_step"] == 6
    assert _restore(cfg, 6)[2]  # the new checkpoint 6 verifies


@pytest.mark.slow
def test_resume_with_changed_keys_is_refused_before_anything_is_written(tmp_path):
    base = ("quantization=te_nvfp4", "steps=2", "checkpoint_period=2", "eval_interval=1000")
    cfg = _config(tmp_path, *base)
    run(cfg, progress=False, devices=ONE_DEVICE)
    run_dir = loop.run_directory(cfg)
    before = _files(run_dir)
    for extra, expected in [
        (["quantization=bf16"], ["quantization: 'te_nvfp4' -> 'bf16'"]),
        (["seed=1", "learning_rate=1e-3"], ["learning_rate: 0.003 -> 0.001", "seed: 0 -> 1"]),
        (["base_emb_dim=256"], ["base_emb_dim: 128 -> 256"]),
        (["per_device_batch_size=4"], ["global batch (per_device_batch_size x devices): 8 -> 4"]),
    ]:
        with pytest.raises(ResumeError) as err:
            run(_config(tmp_path, *base, "steps=4", *extra), progress=False, devices=ONE_DEVICE)
        message = str(err.value)
        assert all(e in message for e in expected), message
        assert "checkpoint step 2" in message and "run_name=" in message and "\n" not in message
        assert _files(run_dir) == before, extra  # config.json, metrics, checkpoints untouched
    with pytest.raises(ResumeError, match="enable_checkpointing=false would start the run over"):
        run(_config(tmp_path, *base, "enable_checkpointing=false"), progress=False, devices=ONE_DEVICE)
    assert _files(run_dir) == before


def test_a_locked_run_directory_is_refused_before_anything_is_written(tmp_path, capsys):
    # 32-bit ids read as uint16: the warning comes first, before the lock is even tried.
    ids = tmp_path / "ids.bin"
    np.random.default_rng(0).integers(0, 256, size=20_000).astype(np.uint32).tofile(ids)
    cfg = _config(tmp_path, "steps=2", "dataset_type=tokens", f"dataset_path={ids}")
    run_dir = loop.run_directory(cfg)
    os.makedirs(run_dir)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with open(os.path.join(run_dir, run_lock.LOCK_NAME), "w") as f:
            json.dump({"host": socket.gethostname(), "pid": holder.pid}, f)
        with pytest.raises(run_lock.RunLockedError, match=rf"in use by pid {holder.pid} on host"):
            run(cfg, progress=False, devices=ONE_DEVICE)
        assert os.listdir(run_dir) == [run_lock.LOCK_NAME]
        assert re.search(r"^warning: .*ids.bin: every odd token id .* is 0", capsys.readouterr().err, re.M)
    finally:
        holder.stdin.close()
        holder.wait()


# --- non-finite states are never saved -----------------------------------------------------

@pytest.mark.slow
def test_non_finite_loss_stops_and_names_a_good_checkpoint(tmp_path):
    cfg = _config(tmp_path, "quantization=bf16", "steps=30", "learning_rate=1e9",
                  "gradient_clipping_threshold=0", "warmup_steps_fraction=0", "checkpoint_period=1",
                  "max_checkpoints_to_keep=2", "eval_interval=1000")
    with pytest.raises(NonFiniteError) as err:
        run(cfg, progress=False, devices=ONE_DEVICE)
    found = re.search(r"Non-finite (?:loss at|state after) step (\d+).*last good checkpoint is step (\d+) .*"
                      r"\(finite and verified\)", str(err.value))
    assert found, str(err.value)
    bad, good = map(int, found.groups())
    assert good == bad - 1
    state, _, verified = _restore(cfg)  # the newest checkpoint is the good one, and it verifies
    assert verified and int(state.step) == good


def _poison_mu_at(inner: optax.GradientTransformation, step: int, leaf: str) -> optax.GradientTransformation:
    """`inner`, except that at optimizer step `step` Adam's first moment of `leaf` becomes NaN
    (the loss and gradients stay finite)."""

    def update(grads, state, params=None):
        updates, state = inner.update(grads, state, params)
        count = next(l for p, l in jax.tree_util.tree_flatten_with_path(state)[0] if "count" in jax.tree_util.keystr(p))
        return updates, jax.tree_util.tree_map_with_path(
            lambda p, l: jnp.where(count == step, jnp.nan, l)
            if ".mu" in jax.tree_util.keystr(p) and leaf in jax.tree_util.keystr(p) else l,
            state,
        )

    return optax.GradientTransformation(inner.init, update)


@pytest.mark.slow
def test_nan_optimizer_state_at_a_checkpoint_step_is_not_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(assembly, "make_optimizer",
                        lambda t: _poison_mu_at(make_optimizer(t), step=4, leaf="final_norm"))
    cfg = _config(tmp_path, "quantization=bf16", "steps=6", "checkpoint_period=2", "max_checkpoints_to_keep=1",
                  "eval_interval=1000")
    with pytest.raises(NonFiniteError) as err:
        run(cfg, progress=False, devices=ONE_DEVICE)
    message = str(err.value)
    assert re.search(r"Non-finite state after step 4: opt_state/1/0/mu/final_norm/scale is not finite", message)
    assert "last good checkpoint is step 2" in message
    # Checkpoint 4 was never written, so rotation (max 1) kept checkpoint 2, which is finite.
    state, _, verified = _restore(cfg)
    assert verified and int(state.step) == 2
    assert os.listdir(os.path.join(loop.run_directory(cfg), "checkpoints")) == ["2"]


@pytest.mark.slow
def test_nan_weights_from_adam_eps_zero_are_never_saved(tmp_path, monkeypatch):
    # The config refuses adam_eps=0 (see test_config.py); force it to show the loop's own guard.
    # With eps=0, a byte that no batch contained has a zero gradient: its embedding row gets
    # 0/0 = NaN while the loss stays finite.
    monkeypatch.setattr(assembly, "make_optimizer", lambda t: make_optimizer(dataclasses.replace(t, adam_eps=0.0)))
    cfg = _config(tmp_path, "quantization=bf16", "steps=3", "checkpoint_period=1", "eval_interval=1000")
    with pytest.raises(NonFiniteError, match=r"Non-finite state after step 1: params/token_embedder/embedding "
                                             r"is not finite.*No checkpoint was saved"):
        run(cfg, progress=False, devices=ONE_DEVICE)
    assert os.listdir(os.path.join(loop.run_directory(cfg), "checkpoints")) == []


# --- quantization_end_step -----------------------------------------------------------------

def _histories(state):
    return [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state.fp8_meta)[0]
            if "history" in jax.tree_util.keystr(path)]


@pytest.mark.slow
def test_quantization_end_step_switches_to_bf16_dots_and_carries_the_fp8_state(tmp_path):
    cfg = _config(tmp_path, "quantization=te_fp8_delayedscaling", "steps=4", "quantization_end_step=2",
                  "checkpoint_period=2", "max_checkpoints_to_keep=5", "eval_interval=1000")
    run(cfg, progress=False, devices=ONE_DEVICE)
    losses = _losses(loop.run_directory(cfg))
    at2, at4 = _restore(cfg, 2)[0], _restore(cfg, 4)[0]
    # The FP8 delayed-scaling state moved during the quantized steps 1-2 (from zeros), and the
    # BF16 steps 3-4 carried it over bit for bit.
    assert len(_histories(at2)) == 2 * 3 * 3 and all(float(np.abs(h).max()) > 0 for h in _histories(at2))
    for a, b in zip(jax.tree.leaves(at2.fp8_meta), jax.tree.leaves(at4.fp8_meta)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    mesh = make_mesh(cfg.mesh, ONE_DEVICE)
    optimizer = make_optimizer(cfg.train)
    quantized, plain = build_model(cfg.model), build_model(cfg.model, quantized=False)
    _, state_sh = state_shardings(quantized, optimizer, 64, mesh)
    train = data_lib.make_dataset(cfg.data, seq_len=64, global_batch_size=8, seed=0, split="train", vocab_size=256)

    def batch(step):
        return {k: jax.device_put(v, batch_sharding(mesh)) for k, v in train.batch(step).items()}

    # Steps 3 and 4 of the run are exactly a BF16 model continued from the step-2 state...
    bf16_step = jit_train_step(plain, optimizer, mesh, state_sh, uses_fp8_meta=False)
    state, continued = at2, []
    for step in (2, 3):
        state, m = bf16_step(state, batch(step))
        continued.append(float(m["loss"]))
    assert continued == [losses[3], losses[4]]
    # ...and not the FP8 model continued from it.
    _, m = jit_train_step(quantized, optimizer, mesh, state_sh)(_restore(cfg, 2)[0], batch(2))
    assert float(m["loss"]) != losses[3]
    # The BF16 model's forward holds no FP8 quantizer; the quantized one's does.
    variables = {"params": at4.params, **at4.fp8_meta}
    tokens = train.batch(0)["inputs"]
    assert "f8_e4m3" not in str(jax.make_jaxpr(lambda v: plain.apply(v, tokens))(variables))
    assert "f8_e4m3" in str(jax.make_jaxpr(
        lambda v: quantized.apply(v, tokens, rngs={"quant": jax.random.PRNGKey(0)}))(variables))


# --- the command line ----------------------------------------------------------------------

def _fresh_clone(tmp_path):
    """A `git clone` of this checkout's HEAD, and a virtual environment for it that reuses the
    test's own interpreter (so setup_env.sh finds it installed and installs nothing)."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-checkout", REPO, str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", head], check=True)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    import hashlib

    digest = hashlib.sha256((clone / "pyproject.toml").read_bytes()).hexdigest()
    (venv / ".nvfp4_jax_installed").write_text(f"{digest} extras=[]\n")
    return clone, venv


@pytest.mark.slow
@pytest.mark.parametrize("quantization_env", [None, "te_fp8_delayedscaling"])
def test_example_script_with_arguments_from_a_fresh_clone(tmp_path, quantization_env, shared_compilation_cache):
    clone, venv = _fresh_clone(tmp_path)
    env = dict(os.environ, VENV=str(venv), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=shared_compilation_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    for name in ("XLA_FLAGS", "NVFP4_JAX_PYTHON", "PYTHONPATH", "QUANTIZATION"):
        env.pop(name, None)  # one CPU device, as a user's machine has; the clone's own package
    # The venv's Python is this test's (whatever the newest Python on the machine is).
    env["NVFP4_JAX_PYTHON_BASE"] = sys.executable
    if quantization_env:
        env["QUANTIZATION"] = quantization_env
    out_dir = tmp_path / "out"
    out = subprocess.run(
        [str(clone / "recipes" / "nvfp4_example.sh"), "steps=2", f"base_output_directory={out_dir}",
         "run_name=example", "base_num_decoder_layers=1", "max_target_length=32", "per_device_batch_size=4",
         "eval_steps=1", "eval_interval=1000", "log_period=1"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "[setup] installing" not in out.stdout + out.stderr  # the environment was reused
    lines = [l for l in out.stdout.splitlines() if l.startswith("completed step:")]
    pattern = (r"completed step: (\d+), seconds: [\d.]+, TFLOP/s/device: [\d.]+, Tokens/s/device: [\d.]+, "
               r"total_weights: 128, loss: [\d.]+, lm_loss: [\d.]+, perplexity: [\d.]+")
    assert [re.fullmatch(pattern, l).group(1) for l in lines] == ["1", "2"], lines
    assert "emulated NVFP4" in out.stdout and "validation loss" in out.stdout
    # Why TE was not chosen is printed, not hidden (here: TE is not installed).
    assert "Transformer Engine not used: Transformer Engine's JAX package" in out.stdout
    # The backend line: auto, and (for NVFP4) why not the xla backend.
    assert "quantization backend: emulated (auto" in out.stdout
    if not quantization_env:
        # Why not xla, in the probe's own words, which depend on the JAX (0.10.2: it does not lower
        # on CPU; 0.11 and later: it lowers as XLA's dequantize-then-dot rewrite, no FP4 GEMM).
        detail = probe_scaled_matmul().detail
        assert f"quantization backend: emulated (auto: jax.nn.scaled_matmul {detail}" in out.stdout, out.stdout[-2000:]
    saved = json.load(open(out_dir / "example" / "config.json"))
    assert saved["train"]["steps"] == 2
    assert saved["model"]["quantization"] == (quantization_env or "te_nvfp4")
    summary = json.load(open(out_dir / "example" / "summary.json"))
    assert summary["run_directory"] == str(out_dir / "example") and summary["step_reached"] == 2


SMALL_PRESETS = [p for p in sorted(glob.glob(os.path.join(REPO, "recipes", "configs", "*.yml")))
                 if load_config([p]).model.model_name in ("tiny", "small-25m")]


@pytest.mark.slow
@pytest.mark.parametrize("path", SMALL_PRESETS, ids=os.path.basename)
def test_small_recipe_yamls_train_one_step(tmp_path, path):
    # A smoke run: the preset builds, steps, evaluates and checkpoints (a second step adds
    # nothing). The first step's loss (at init) is near ln(vocab) (5.55 for bytes; measured:
    # tiny 6.18, small-25m 6.00): far above it means a broken init or loss. One update then
    # moves the held-out loss down but not to a model that has seen its targets (measured after
    # one step: small-25m 4.46; bytes of English text carry about 2 nats of unigram information).
    cfg = load_config([path, "steps=1", "eval_steps=1", f"base_output_directory={tmp_path}", "run_name=yaml",
                       "ici_fsdp_parallelism=1", "checkpoint_period=1"])
    summary = run(cfg, progress=False, devices=ONE_DEVICE)
    assert summary["last_checkpoint_step"] == 1
    uniform = np.log(cfg.model.vocab_size)
    assert uniform - 0.5 < summary["first_train_loss"] < uniform + 1.0, (summary["first_train_loss"], uniform)
    assert uniform - 2.0 < summary["final_eval_loss"] < summary["first_train_loss"] + 0.1, summary


def _cli(tmp_path, *args, **env):
    return subprocess.run(
        [sys.executable, "-m", "nvfp4_jax.train", *args], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", **env),
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["quantization=te_nvfp5"], r"quantization='te_nvfp5'.*te_nvfp4"),
        (["bad.yml"], r"bad.yml' is not valid YAML at line 2"),
        (["."], r"'\.' is a directory"),
        (["quantization=te_nvfp4", "max_target_length=60"], r"max_target_length=60 .*multiple of 16"),
        (["adam_eps=0"], r"adam_eps=0.0"),
        (["run_name=../../escaped"], r"run_name='../../escaped'"),
        (["--frobnicate"], r"Unknown option '--frobnicate'"),
        (["dataset_type=tokens", "dataset_path=nope.bin"], r"dataset_path 'nope.bin' does not exist"),
    ],
)
def test_user_errors_are_one_line_and_exit_2_before_compiling(tmp_path, args, message):
    (tmp_path / "bad.yml").write_text("steps: 3\n  oops: [\n")
    out = _cli(tmp_path, *args)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), out.stderr
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path.parent / "escaped")


def test_debug_shows_the_traceback(tmp_path):
    for out in (_cli(tmp_path, "--debug", "adam_b1=2"), _cli(tmp_path, "adam_b1=2", NVFP4_JAX_DEBUG="1")):
        assert out.returncode == 2
        assert "Traceback" in out.stderr and out.stderr.strip().splitlines()[-1].startswith("error: adam_b1=2.0")


@pytest.mark.parametrize(
    "outcome, code",
    [
        (NonFiniteError("Non-finite loss at step 3"), 3),
        (checkpoint.CheckpointError("No intact checkpoint"), 4),
        (run_lock.RunLockedError("in use"), 2),
        (data_lib.DataError("short file"), 2),
        ({"stopped_by": "SIGTERM", "steps": 5, "step_reached": 2}, 75),
        ({"stopped_by": None, "steps": 5, "step_reached": 5}, 0),
    ],
)
def test_exit_codes(monkeypatch, capsys, outcome, code):
    from nvfp4_jax.train.__main__ import main

    def fake_run(cfg):
        if isinstance(outcome, Exception):
            raise outcome
        return {"quantization": "bf16", "first_train_loss": 1.0, "final_train_loss": 1.0,
                "final_eval_loss": 1.0, "median_tokens_per_second_per_device": 1.0,
                "run_directory": "x", **outcome}

    monkeypatch.setattr(loop, "run", fake_run)
    assert main(["steps=5"]) == code
    err = capsys.readouterr().err
    if isinstance(outcome, Exception):
        assert err == f"error: {outcome}\n"


@pytest.mark.slow
def test_xplane_profile_is_written(tmp_path):
    cfg = _config(tmp_path, "quantization=te_nvfp4", "steps=3", "profiler=xplane", "profile_start_step=1",
                  "profile_steps=1", "enable_checkpointing=false", "eval_interval=1000")
    run(cfg, progress=False, devices=ONE_DEVICE)
    traces = [os.path.join(root, f) for root, _, files in os.walk(os.path.join(tmp_path, "run", "profile"))
              for f in files if f.endswith(".xplane.pb")]
    assert traces and os.path.getsize(traces[0]) > 0
