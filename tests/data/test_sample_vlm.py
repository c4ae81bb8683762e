"""`python -m nvfp4_jax.sample RUN_DIR --prompt "..." --image PATH | --image-index N` on a VLM run:
the answer is the held-out VQA's greedy answer (train/vqa.py, an independent decoder) for the same
image and prompt, an image given as a file answers as the held-out image it holds, and every
wrong image argument is one `error:` line with exit 2 before anything loads a checkpoint."""

import dataclasses
import os
import re

import jax
import numpy as np
import pytest

from nvfp4_jax import sample
from nvfp4_jax.config import load_config, save_json
from nvfp4_jax.data import digits
from nvfp4_jax.train import assembly, loop, vqa
from nvfp4_jax.train.build import build_model

PRESET = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "configs", "vlm-tiny.yml")
# The preset, cheaper: one layer per tower, BF16, 35 held-out images (2% of 1,797).
SMALL = [PRESET, "quantization=bf16", "base_num_decoder_layers=1", "vision_num_layers=1",
         "per_device_batch_size=16", "eval_fraction=0.02", "eval_steps=1", "enable_tensorboard=false"]
HELD_OUT = 35


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture
def vlm_run(tmp_path):
    """A VLM run directory with its config.json and no checkpoint: every image check comes first."""
    run = tmp_path / "vlm"
    run.mkdir()
    save_json(load_config(SMALL), str(run / "config.json"))
    return run


def _array(tmp_path, name, shape):
    path = tmp_path / name
    np.save(path, np.zeros(shape, np.uint8))
    return str(path)


def _png(tmp_path, name, size, mode):
    image = pytest.importorskip("PIL.Image")
    path = tmp_path / name
    image.new(mode, (size, size)).save(path)
    return str(path)


@pytest.mark.parametrize("image_args, message", [
    (lambda d: ["--image", str(d / "missing.npy")],
     r"--image: image '.*missing\.npy' does not exist or is not a file$"),
    (lambda d: ["--image", _array(d, "big.npy", (10, 10))],
     r"--image '.*big\.npy' is \(10, 10, 1\) \(height, width, channels\), but this run's model reads \(8, 8, 1\) "
     r"\(image_size=8, image_channels=1\)\.$"),
    (lambda d: ["--image", _array(d, "rgb.npy", (8, 8, 3))],
     r"--image '.*rgb\.npy' is \(8, 8, 3\) .* reads \(8, 8, 1\)"),
    (lambda d: ["--image", _array(d, "flat.npy", (64,))],
     r"--image: image '.*flat\.npy' has shape \(64,\): expected \(height, width\) or \(height, width, channels\)$"),
    (lambda d: ["--image", _png(d, "big.png", 10, "L")], r"--image '.*big\.png' is \(10, 10, 1\) .* reads \(8, 8, 1\)"),
    (lambda d: ["--image", _png(d, "rgb.png", 8, "RGB")], r"--image '.*rgb\.png' is \(8, 8, 3\) .* reads \(8, 8, 1\)"),
    (lambda d: ["--image-index", str(HELD_OUT)],
     rf"--image-index={HELD_OUT} is out of range: the run's held-out split of scikit-learn digits has {HELD_OUT} "
     rf"images, numbered 0 to {HELD_OUT - 1}\.$"),
    (lambda d: ["--image-index", "-1"], r"--image-index=-1 is out of range: .* numbered 0 to "),
    (lambda d: ["--image", _array(d, "ok.npy", (8, 8)), "--image-index", "0"],
     r"--image '.*ok\.npy' and --image-index 0: give one of them, not both\.$"),
    (lambda d: [], r"this run is a VLM \(model_type='vlm'\): give the image to ask about, --image PATH \(a \.npy or "
                   r"\.png file\) or --image-index N \(a held-out image of the run's dataset\)\.$"),
    (lambda d: ["--image-index", "x"], r"argument --image-index: invalid int value: 'x'"),
    (lambda d: ["--image-index", "0", "--prompt", "why? " * 10],
     r"--prompt is 51 bytes with the ' ' after it, but this run's rows hold 48 text tokens \(max_target_length - "
     r"image tokens\): shorten it"),
], ids=["missing", "too-big-npy", "three-channel-npy", "1d-npy", "too-big-png", "rgb-png", "index-past-end",
        "negative-index", "both", "neither", "index-not-int", "prompt-too-long"])
def test_a_wrong_image_argument_is_one_line_exit_2(vlm_run, capsys, image_args, message):
    args = image_args(vlm_run)
    if "--prompt" not in args:
        args += ["--prompt", "what digit is this?"]
    assert sample.main([str(vlm_run), *args]) == 2
    line = _error_line(capsys)
    assert re.search(message, line), line


def test_a_wrong_extension_is_named(vlm_run, capsys):
    path = vlm_run / "image.txt"
    path.write_text("8x8")
    assert sample.main([str(vlm_run), "--image", str(path)]) == 2
    assert re.search(r"--image: image '.*image\.txt': read \.npy arrays or \.png files$", _error_line(capsys))


@pytest.mark.parametrize("image_args", [["--image", "cat.npy"], ["--image-index", "0"],
                                        ["--image", "cat.npy", "--image-index", "0"]])
def test_an_image_for_a_text_run_is_refused(tmp_path, capsys, image_args):
    save_json(load_config(["model_name=tiny"]), str(tmp_path / "config.json"))
    assert sample.main([str(tmp_path), "--prompt", "To be", *image_args]) == 2
    line = _error_line(capsys)
    given = " and ".join(["--image 'cat.npy'"] * ("--image" in image_args)
                         + ["--image-index 0"] * ("--image-index" in image_args))
    assert line == (f"error: {given}: this run's model_type='llama' reads text only; "
                    "an image is for a model_type='vlm' run.")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(config, run directory) of 100 steps of the small VLM, checkpointed at the end."""
    cfg = load_config(SMALL + ["steps=100", "eval_interval=100", "checkpoint_period=100", "log_period=50",
                               f"base_output_directory={tmp_path_factory.mktemp('runs')}"])
    return cfg, loop.run(cfg, progress=False, devices=jax.devices()[:1])["run_directory"]


def _ask(capsys, run_dir, prompt, *image_args) -> tuple[str, str]:
    """(the answer on stdout, the `[checkpoint ...]` line on stderr) of one sample command."""
    assert sample.main([run_dir, "--prompt", prompt, *image_args]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and out.count("\n") == 1, out
    return out[:-1], [line for line in err.splitlines() if line.startswith("[checkpoint")][-1]


@pytest.mark.slow
def test_sample_answers_as_the_held_out_vqa_answers_and_a_file_as_its_held_out_image(trained, tmp_path, capsys):
    cfg, run_dir = trained
    data = assembly.assemble(cfg, jax.devices()[:1]).dataset("eval")  # what the trainer evaluates on
    assert len(data.image_ids) == HELD_OUT
    index = 3
    image = int(data.image_ids[index])
    questions = [e for e in data.examples if e.image == image]
    assert [e.kind for e in questions] == list(digits.KINDS)
    # The reference: vqa.py's batched greedy decoder over the eval split, the same BF16 forward.
    model = build_model(dataclasses.replace(cfg.model, dtype="bfloat16"), quantized=False)
    params, step = sample.load_params(run_dir, cfg)
    greedy = vqa.greedy_answers(model, {"params": params}, data, questions, jax.random.PRNGKey(0))
    label = int(digits.load_images()[1][image])
    for e, reference_bytes in zip(questions, greedy):
        reference = bytes(reference_bytes.astype(np.uint8))
        assert b"\n" in reference, (e, reference)  # 100 steps teach where an answer ends
        answer, about = _ask(capsys, run_dir, e.prompt, "--image-index", str(index))
        assert answer.encode() == reference[:reference.index(b"\n")], (e, answer, reference)
        assert about == (f"[checkpoint step {step} of {os.path.abspath(run_dir)}; held-out image {index} of "
                         f"{HELD_OUT}: scikit-learn digits image {image}; reference answer {e.answer!r}]")
        assert e == next(q for q in digits.examples_of(image, label) if q.prompt == e.prompt)
    answers = {e.prompt: _ask(capsys, run_dir, e.prompt, "--image-index", str(index))[0] for e in questions[::3]}

    # The same pixels from a file: float .npy as they are; uint8 .npy and PNG both divided by 255.
    np.save(tmp_path / "held_out.npy", data.images[image])
    pixels_255 = np.round(data.images[image][..., 0] * 255).astype(np.uint8)
    np.save(tmp_path / "held_out_255.npy", pixels_255)
    pytest.importorskip("PIL.Image").fromarray(pixels_255).save(tmp_path / "held_out_255.png")
    for prompt, answer in answers.items():
        from_file, about = _ask(capsys, run_dir, prompt, "--image", str(tmp_path / "held_out.npy"))
        assert from_file == answer and about.endswith(f"; image {tmp_path / 'held_out.npy'}]")
        assert (_ask(capsys, run_dir, prompt, "--image", str(tmp_path / "held_out_255.png"))[0]
                == _ask(capsys, run_dir, prompt, "--image", str(tmp_path / "held_out_255.npy"))[0])

    # A prompt the dataset never asks is answered too, and the line lists what it asks.
    _, about = _ask(capsys, run_dir, "hello", "--image-index", str(index))
    assert about.endswith("; no reference answer to this prompt; the dataset asks it "
                          + ", ".join(repr(e.prompt) for e in questions) + "]")
