"""The training command on a prepared corpus: bad inputs stop it with one line before anything
compiles (fast, in-process), and kill -9 + rerun reproduces the uninterrupted losses (slow,
real processes), after which `sample` reads the run."""

import os
import re
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "train"))
import corpora  # noqa: E402

from nvfp4_jax.data.__main__ import prepare  # noqa: E402
from nvfp4_jax.train.__main__ import main as train_main  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    jsonl = corpora.write_jsonl(out / "corpus.jsonl", [t for t in corpora.TEXTS[:6]] * 2)
    prepare([jsonl], str(out / "prepared"), progress=False)
    return str(out / "prepared" / "documents.array_record")


def _train_error(tmp_path, capsys, *args):
    code = train_main(["model_name=tiny", "vocab_size=258", f"base_output_directory={tmp_path / 'runs'}", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not os.path.exists(tmp_path / "runs")  # stopped before the run directory existed
    return lines[0]


def test_bad_document_inputs_stop_training_with_one_line(tmp_path, capsys, prepared):
    bad = tmp_path / "bad.array_record"
    bad.write_bytes(b"\x00" * 70_000)
    jsonl = corpora.write_jsonl(tmp_path / "c.jsonl", ["text"] * 4)
    cases = [
        (["dataset_type=grain"], r"grain_train_files='' is not allowed"),
        (["dataset_type=grain", f"grain_train_files={tmp_path}/nope.array_record"], r"matches no file"),
        (["dataset_type=grain", f"grain_train_files={bad}"], r"is not a readable ArrayRecord file"),
        (["dataset_type=hf", f"hf_train_files={jsonl}", "train_data_columns=body"], r"has no column 'body'"),
        (["dataset_type=grain", f"grain_train_files={prepared}", "vocab_size=256"],
         r"vocab_size=256 is smaller than the tokenizer bytes"),
        (["dataset_type=grain", f"grain_train_files={prepared}", "tokenizer_type=gpt2"],
         r"tokenizer_type='gpt2' is not allowed: choose one of \['bytes', 'huggingface'"),
        (["dataset_type=grain", f"grain_train_files={prepared}", "tokenizer_type=huggingface",
          f"tokenizer_path={tmp_path}/missing.json"], r"tokenizer_path='.*missing.json' does not exist"),
    ]
    for args, message in cases:
        assert re.search(message, _train_error(tmp_path, capsys, *args))


def _losses(run_dir):
    import _helpers

    return _helpers.train_losses(run_dir)


@pytest.mark.slow
def test_kill_9_and_rerun_reproduce_the_losses_bit_for_bit_then_sample(tmp_path, prepared):
    import _helpers

    _helpers.COMPILATION_CACHE["dir"] = str(tmp_path / "jax-cache")
    for name in ("reference", "killed"):
        (tmp_path / name).mkdir()
    grain = ["dataset_type=grain", f"grain_train_files={prepared}", "vocab_size=258", "packing=true"]
    reference = _helpers.Training(tmp_path / "reference", *grain)
    assert reference.finish() == 0, reference.stderr[-3000:]
    expected = _losses(reference.run_dir)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert any(line.startswith("data: batch") and "starts epoch 2" in line for line in reference.stdout)

    run = _helpers.Training(tmp_path / "killed", *grain)
    run.wait_for("completed step: 3")  # checkpoint step 2 is on disk, maybe 4 too
    run.proc.send_signal(signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    again = _helpers.Training(tmp_path / "killed", *grain)
    assert again.finish() == 0, again.stderr[-3000:]
    assert any("Resumed from checkpoint step" in line for line in again.stdout)
    assert _losses(again.run_dir) == expected  # every step, bit for bit (floats compared exactly)

    out = subprocess.run([sys.executable, "-m", "nvfp4_jax.sample", again.run_dir, "--prompt", "To be",
                          "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=_helpers.cli_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("To be") and "checkpoint step 6" in out.stderr


def test_the_loop_hands_every_batch_key_to_the_step(tmp_path, capsys):
    import types

    import jax
    import numpy as np

    from nvfp4_jax import data, sharding
    from nvfp4_jax.config import DataConfig, MeshConfig
    from nvfp4_jax.data import packing
    from nvfp4_jax.train import assembly
    from nvfp4_jax.train.loop import place

    texts = [f"document {i} " * (i % 4 + 1) for i in range(20)]
    cfg = DataConfig(dataset_type="grain", grain_train_files=corpora.write_parquet(tmp_path / "d.parquet", texts))
    ds = data.make_dataset(cfg, seq_len=32, global_batch_size=8, seed=0, split="train", vocab_size=258)
    mesh = sharding.make_mesh(MeshConfig())
    batch_sh = sharding.batch_sharding(mesh)
    # The builder's batch placement (assembly.Run.put) on this mesh's batch sharding.
    placement = types.SimpleNamespace(batch_sharding=batch_sh)
    run_parts = types.SimpleNamespace(put=lambda b: assembly.Run.put(placement, b))
    said = []
    small = data.make_dataset(DataConfig(**{**cfg.__dict__, "grain_train_files": corpora.write_parquet(
        tmp_path / "s.parquet", texts[:3])}), seq_len=32, global_batch_size=8, seed=0, split="train", vocab_size=258)
    for dataset in (ds, small):
        step = 1
        put = place(run_parts, dataset, step, said.append)
        assert sorted(put) == sorted(packing.BATCH_KEYS)
        for key, value in dataset.batch(step).items():
            assert put[key].sharding == batch_sh
            np.testing.assert_array_equal(jax.device_get(put[key]), value)
    assert any("data: batch 1 starts epoch" in line for line in said)  # the small corpus's new epoch is said


@pytest.mark.slow
def test_the_real_data_example_script_runs_on_the_bundled_corpus(tmp_path):
    env = dict(os.environ, NVFP4_JAX_PYTHON=sys.executable, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
               REAL_DATA_DIR=str(tmp_path / "work"))
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's machine has
    out = subprocess.run(
        [os.path.join(REPO, "recipes", "real_data_example.sh"), "steps=2", "base_num_decoder_layers=1",
         "max_target_length=32", "per_device_batch_size=4", "eval_steps=1", "log_period=1"],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert re.search(r"prepared 39,362 documents, 4,987,07\d tokens", out.stdout)
    assert re.search(r"documents.array_record train: [\d,]+ documents, .* packed into", out.stdout)
    assert "completed step: 2," in out.stdout
    assert re.search(r"^ROMEO:$", out.stdout, re.M)  # sample's continuation of the prompt
