"""A federated VLM: the digits' training images split between the sites (Dirichlet over the
classes and the task mix), a centrally pretrained backbone (`--backbone RUN_DIR`), adapters that
alone cross the network, and the server's held-out VQA every round."""

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("sklearn")

from nvfp4_jax.config import ConfigError, load_config, save_json  # noqa: E402
from nvfp4_jax.data import digits  # noqa: E402
from nvfp4_jax.data.image_batches import pixel_hash, split_images  # noqa: E402
from nvfp4_jax.data.image_text import read_examples  # noqa: E402
from nvfp4_jax.federated.image_split import split_examples, write_site_images  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "configs", "vlm-tiny.yml")


def _split(num_sites, alpha, seed, eval_fraction=0.2):
    images, labels = digits.load_images()
    ids = split_images(images, eval_fraction, seed)
    return images, labels, ids, split_examples(labels, ids["train"], num_sites, alpha, seed)


@pytest.mark.parametrize("num_sites", [1, 3, 8])
def test_no_site_holds_a_held_out_image_and_none_is_empty(num_sites):
    images, _, ids, sites = _split(num_sites, 0.1, seed=0)
    held = set(ids["eval"].tolist())
    held_pixels = {pixel_hash(images[i]) for i in held}
    assert len(sites) == num_sites and all(sites)
    for examples in sites:
        shown = {e.image for e in examples}
        assert not shown & held
        assert not {pixel_hash(images[i]) for i in shown} & held_pixels  # not even a duplicate's pixels
    # Each training image lies at one site only.
    owners = collections.Counter(i for examples in sites for i in {e.image for e in examples})
    assert max(owners.values()) == 1 and set(owners) <= set(ids["train"].tolist())


def test_the_split_is_a_function_of_the_seed():
    assert _split(3, 0.5, seed=4)[3] == _split(3, 0.5, seed=4)[3]
    assert _split(3, 0.5, seed=4)[3] != _split(3, 0.5, seed=5)[3]


def _class_share(labels, sites):
    """Per digit class, the largest share of its images one site holds, averaged over classes."""
    counts = np.zeros((len(sites), 10))
    for s, examples in enumerate(sites):
        for i in {e.image for e in examples}:
            counts[s, labels[i]] += 1
    return float(np.mean(counts.max(axis=0) / counts.sum(axis=0)))


def _task_share(sites):
    """Per site, its commonest question type's share of its examples, averaged over sites."""
    return float(np.mean([max(collections.Counter(e.kind for e in ex).values()) / len(ex) for ex in sites]))


def test_a_small_alpha_skews_classes_and_tasks_a_large_one_is_near_uniform():
    _, labels, _, _ = _split(1, 1.0, 0)
    small = [_split(3, 0.05, s)[3] for s in range(5)]
    large = [_split(3, 1000.0, s)[3] for s in range(5)]
    # IID: each site holds ~1/3 of a class and ~1/4 of its examples are of each type.
    assert np.mean([_class_share(labels, s) for s in small]) > 0.85
    assert np.mean([_class_share(labels, s) for s in large]) < 0.40
    assert np.mean([_task_share(s) for s in small]) > 0.8
    assert np.mean([_task_share(s) for s in large]) < 0.30
    # Near-uniform: every site keeps nearly all four examples of each of its images.
    for sites in large:
        assert all(len(ex) > 3.7 * len({e.image for e in ex}) for ex in sites)


def test_the_site_folders_are_image_text_data_of_the_digits_own_pixels(tmp_path):
    holdings = write_site_images(str(tmp_path), 2, alpha=1.0, seed=0, eval_fraction=0.2)
    images, labels = digits.load_images()
    train = set(split_images(images, 0.2, 0)["train"].tolist())
    total = 0
    for h in holdings:
        site_images, examples = read_examples(h["path"])
        assert len(examples) == h["examples"] and len(site_images) == h["images"]
        with open(h["path"]) as f:
            rows = [json.loads(line) for line in f]
        for row, e in zip(rows, examples):
            index = int(row["image"].split("/")[1].split(".")[0])
            assert index in train
            np.testing.assert_array_equal(site_images[e.image], images[index])
            assert e.answer in [x.answer for x in digits.examples_of(index, int(labels[index]))]
        total += h["images"]
    assert total == len(train)


def _build(tmp_path, *argv):
    pytest.importorskip("nvflare")
    from nvfp4_jax.federated.__main__ import build_spec

    return build_spec([RECIPE, *argv, f"base_output_directory={tmp_path}"])


def test_a_vlm_job_trains_each_site_on_its_own_split(tmp_path):
    spec, _, files = _build(tmp_path, "--sites", "2", "--rounds", "3", "--update", "adapters", "lora_rank=8",
                            "--dirichlet-alpha", "0.3")
    assert files.images is not None and files.images[1:] == (0.3, 0, 0.2)
    assert [s.data_path for s in spec.sites] == [
        os.path.join(files.images[0], f"site-{i}", "examples.jsonl") for i in (1, 2)]
    # The recipe's 600 central steps give way to the rounds' (3 rounds x 4 steps); steps= is kept.
    assert spec.run_config["steps"] == 12
    assert _build(tmp_path, "--update", "adapters", "lora_rank=8", "steps=50")[0].run_config["steps"] in (50, "50")
    # Adapters and the projector: the site trains both (train_params=all under the contract's freeze).
    spec, _, _ = _build(tmp_path, "--update", "adapters", "--trainable", "projector", "lora_rank=8")
    assert spec.contract.trainable == "projector" and spec.run_config["train_params"] == "all"


def _fake_run(path, *keys, step=True):
    """A run directory's config.json (and a checkpoint step folder) of `vlm-tiny.yml` + keys."""
    os.makedirs(path / "checkpoints" / "20" if step else path, exist_ok=True)
    save_json(load_config([RECIPE, *keys]), str(path / "config.json"))
    return str(path)


@pytest.mark.parametrize("make, argv, message", [
    (lambda p: str(p), [], "is not a run directory: it has no config.json"),
    (lambda p: _fake_run(p, step=False), [], "holds no checkpoint (checkpoints/<step>): train it first"),
    (lambda p: _fake_run(p, "vision_emb_dim=32"), [], "is a run of another model: vision_emb_dim=32 (this job: 64)"),
    (lambda p: _fake_run(p, "model_type=llama", "dataset_type=synthetic"), [], "is a run of another model: model_type='llama'"),
    (lambda p: _fake_run(p, "lora_rank=4"), [], "has LoRA adapters of its own (lora_rank=4)"),
    (lambda p: _fake_run(p, "seed=3"), [], "held out other data than this job evaluates on (seed=3 (this job: 0))"),
    (lambda p: _fake_run(p), ["load_parameters_path=/x"], "--backbone sets load_parameters_path: give one of them"),
])
def test_a_bad_backbone_is_one_line(tmp_path, make, argv, message):
    run = make(tmp_path / "run")
    with pytest.raises(ConfigError) as err:
        _build(tmp_path / "out", "--update", "adapters", "lora_rank=8", "--backbone", run, *argv)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("argv, message", [
    (["--update", "adapters"], "error: --update adapters sends the LoRA adapters: give the model some"),
    (["--backbone", "/nonexistent"], "error: --backbone '/nonexistent': '/nonexistent' is not a run directory"),
    (["dataset_type=image_text", "dataset_path=x.jsonl"], "error: a federated VLM splits the digits"),
    (["--dirichlet-alpha", "0"], "error: --dirichlet-alpha=0.0 must be > 0"),
])
def test_bad_vlm_jobs_exit_2_with_one_error_line(tmp_path, capsys, argv, message):
    pytest.importorskip("nvflare")
    from nvfp4_jax.federated.__main__ import main

    assert main([RECIPE, *argv, f"base_output_directory={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err


# Tiny sizes for CI: a 20-step central backbone, then 2 sites x 2 rounds of rank-8 adapters.
SMALL = ["per_device_batch_size=8", "eval_steps=1", "log_period=10"]


def _python(*argv):
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_two_sites_train_adapters_of_a_central_backbone_and_the_server_scores_vqa(tmp_path):
    pytest.importorskip("nvflare")
    _python("nvfp4_jax.train", RECIPE, *SMALL, "steps=20", "checkpoint_period=20", "eval_interval=20",
            "run_name=backbone", f"base_output_directory={tmp_path}")
    out = _python("nvfp4_jax.federated", RECIPE, "--sites", "2", "--rounds", "2", "--update", "adapters",
                  "lora_rank=8", "--backbone", str(tmp_path / "backbone"), "--samples-per-round", "32",
                  "--dirichlet-alpha", "0.5", *SMALL, f"base_output_directory={tmp_path}")
    run = tmp_path / "federated"
    with open(run / "federated.json") as f:
        rounds = json.load(f)["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    lines = [line for line in out.splitlines() if line.startswith("[federated] round")]
    assert len(lines) == 3 and all("held-out VQA" in line for line in lines)
    for r in rounds:  # every held-out question, every round
        assert 0 <= r["vqa_accuracy"] <= 1 and r["vqa_questions"] == 1436
        assert r["vqa_chance"] == pytest.approx(rounds[0]["vqa_chance"]) and 0.2 < r["vqa_chance"] < 0.5

    # The initial global model is the central run's newest checkpoint; after two rounds its
    # backbone is that checkpoint bit for bit, and only the adapters moved (B started at 0).
    from flax import traverse_util

    from nvfp4_jax.train.run_dir import read_run_config
    from nvfp4_jax.train.run_params import newest_params

    params, step = newest_params(str(tmp_path / "backbone"), read_run_config(str(tmp_path / "backbone")))
    assert step == 20
    backbone = {k: np.asarray(v) for k, v in traverse_util.flatten_dict(params, sep="/").items()}
    model = np.load(run / "global_model.npz")
    adapters = [k for k in model.files if k.rsplit("/", 1)[-1] in ("lora_a", "lora_b")]
    assert adapters and set(model.files) - set(adapters) == set(backbone)
    for name in backbone:
        np.testing.assert_array_equal(model[name], backbone[name], err_msg=name)
    assert all(np.abs(model[k]).max() > 0 for k in adapters if k.endswith("lora_b"))

    # Only the adapters crossed the network, both ways: a small fraction of full-model FedAvg.
    adapter_bytes = sum(model[k].nbytes for k in adapters)
    full_bytes = sum(model[k].nbytes for k in model.files)
    for r in rounds[1:]:
        assert r["full_model_bytes"] == full_bytes and r["downlink_bytes_per_site"] == adapter_bytes
        assert r["bytes_sent"] == 2 * adapter_bytes
        assert r["bytes_sent"] / (2 * full_bytes) < 0.2

    # --trainable projector: the adapters and the projector train and travel, the rest stays the
    # backbone's bit for bit.
    _python("nvfp4_jax.federated", RECIPE, "--sites", "2", "--rounds", "1", "--update", "adapters",
            "--trainable", "projector", "lora_rank=8", "--backbone", str(tmp_path / "backbone"),
            "--samples-per-round", "32", *SMALL, f"base_output_directory={tmp_path / 'projector'}")
    with open(tmp_path / "projector" / "federated" / "federated.json") as f:
        (_, last) = json.load(f)["rounds"]
    model = np.load(tmp_path / "projector" / "federated" / "global_model.npz")
    projector = [k for k in backbone if k.startswith("projector/")]
    assert projector and all(not np.array_equal(model[k], backbone[k]) for k in projector)
    for name in set(backbone) - set(projector):
        np.testing.assert_array_equal(model[name], backbone[name], err_msg=name)
    moved = sum(model[k].nbytes for k in adapters + projector)
    assert last["downlink_bytes_per_site"] == moved and last["bytes_sent"] == 2 * moved


def test_a_vlm_site_reads_its_data_as_image_text_and_the_round_line_shows_the_vqa():
    pytest.importorskip("nvflare")
    from nvfp4_jax.federated.client import site_data_overrides
    from nvfp4_jax.federated.server import round_line

    assert site_data_overrides({"model_type": "vlm"}, "s/examples.jsonl") == {
        "dataset_type": "image_text", "dataset_path": "s/examples.jsonl"}
    assert site_data_overrides({}, "s.txt") == {"dataset_type": "text", "dataset_path": "s.txt"}
    assert site_data_overrides({"model_type": "vlm"}, "") == {}
    record = {"round": 1, "validation_loss": 0.5, "vqa_accuracy": 0.75, "vqa_chance": 0.326,
              "budgets": {"site-1": 8, "site-2": 8}, "makespan_s": 1.0, "bytes_sent": 2000,
              "full_model_bytes": 10000, "sites": {"site-1": {}, "site-2": {}, "site-3": {"failed": True}}}
    line = round_line(record, 2)
    assert "global validation loss 0.5000, held-out VQA 0.750 (chance 0.326)" in line
    assert "sent 0.002 MB (10.0% of full models)" in line  # the two sites that sent: 2 x 10000 bytes
