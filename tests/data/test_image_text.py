"""Image-text examples (data/image_batches.py, digits.py, image_text.py): the held-out images
never reach training, the loss mask covers the answers, batches are pure functions of the step,
the user's files read as the digits do, and vqa_chance counts the best constant answer."""

import json

import numpy as np
import pytest

from nvfp4_jax.config import make_config
from nvfp4_jax.data import DataError, make_dataset
from nvfp4_jax.data import digits
from nvfp4_jax.data.fingerprint import data_entries
from nvfp4_jax.data.image_batches import Example, pixel_hash, split_images, text_row
from nvfp4_jax.data.packing import BATCH_KEYS
from nvfp4_jax.train.vqa import exact_match, vqa_chance

SHAPE = (8, 8, 1)


def _digits(split, seed=0, **keys):
    cfg = make_config({"model_type": "vlm", "dataset_type": "digits", "eval_fraction": 0.2, **keys})
    return make_dataset(cfg.data, seq_len=48, global_batch_size=8, seed=seed, split=split, vocab_size=256,
                        image_shape=SHAPE)


def test_held_out_images_never_appear_in_training_by_index_or_by_pixels():
    train, held = _digits("train"), _digits("eval")
    assert len(train.image_ids) + len(held.image_ids) == 1797 and 0.19 < len(held.image_ids) / 1797 < 0.21
    assert not set(train.image_ids.tolist()) & set(held.image_ids.tolist())
    train_hashes = {pixel_hash(train.images[i]) for i in train.image_ids}
    assert not train_hashes & {pixel_hash(held.images[i]) for i in held.image_ids}
    seen = {pixel_hash(b) for step in range(50) for b in train.batch(step)["images"]}
    assert seen <= train_hashes
    assert {e.image for e in held.examples} == set(held.image_ids.tolist())
    assert sorted({e.kind for e in held.examples}) == sorted(digits.KINDS)


def test_identical_images_stay_on_one_side_and_the_split_follows_the_seed():
    images = np.zeros((10, 2, 2, 1), np.float32)
    images[:, 0, 0, 0] = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]  # each image twice
    for seed in range(5):
        split = split_images(images, 0.3, seed)
        held = {float(images[i, 0, 0, 0]) for i in split["eval"]}
        assert held and not held & {float(images[i, 0, 0, 0]) for i in split["train"]}
    a, b = split_images(images, 0.3, 0), split_images(images, 0.3, 0)
    assert np.array_equal(a["eval"], b["eval"])
    real = digits.load_images()[0]
    assert not np.array_equal(split_images(real, 0.2, 0)["eval"], split_images(real, 0.2, 1)["eval"])


def test_the_digit_examples_say_what_the_image_shows():
    label = int(digits.load_images()[1][5])
    answers = {e.kind: e.answer for e in digits.examples_of(5, label)}
    assert answers["digit"] == str(label) and answers["parity"] == ("even" if label % 2 == 0 else "odd")
    assert answers["caption"] == f"a handwritten {digits.DIGIT_NAMES[label]}"
    assert answers["greater"] == ("yes" if label > digits.threshold(5) else "no")


def test_the_loss_mask_is_exactly_the_answer_tokens():
    row = text_row(Example(0, "what digit is this?", "7", "digit"), 32)
    counted = row["targets"][row["targets_segmentation"] == 1]
    assert bytes(counted.astype(np.uint8)) == b"7\n"
    assert bytes(row["inputs"][:20].astype(np.uint8)) == b"what digit is this? "
    with pytest.raises(DataError, match="longer than the 8 text tokens"):
        text_row(Example(0, "what digit is this?", "7", "digit"), 8)


def test_a_batch_is_a_pure_function_of_the_step():
    data, again = _digits("train", seed=3), _digits("train", seed=3)
    a, b = data.batch(4), again.batch(4)
    assert set(a) == set(BATCH_KEYS) | {"images"} and a["images"].shape == (8,) + SHAPE
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(data.batch(0)["inputs"], data.batch(1)["inputs"])
    halves = [data.batch(5, process_index=i, process_count=2)["images"] for i in (0, 1)]
    np.testing.assert_array_equal(np.concatenate(halves), data.batch(5)["images"])


def _write_examples(tmp_path, rows):
    path = tmp_path / "examples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_users_npy_and_png_images_read_with_a_jsonl(tmp_path):
    from PIL import Image

    rows = []
    for i in range(6):
        pixels = np.full((8, 8), 40 * i, np.uint8)
        if i % 2:
            Image.fromarray(pixels).save(tmp_path / f"im{i}.png")
        else:
            np.save(tmp_path / f"im{i}.npy", pixels)
        name = f"im{i}.{'png' if i % 2 else 'npy'}"
        rows += [{"image": name, "prompt": "bright?", "answer": "yes" if i > 2 else "no", "type": "bright"}]
    path = _write_examples(tmp_path, rows)
    cfg = make_config({"model_type": "vlm", "dataset_type": "image_text", "dataset_path": str(path),
                       "eval_fraction": 0.34})
    kw = dict(seq_len=16, global_batch_size=2, seed=0, vocab_size=256, image_shape=SHAPE)
    train, held = (make_dataset(cfg.data, split=s, **kw) for s in ("train", "eval"))
    assert len(train.examples) + len(held.examples) == 6 and len(held.examples) == 2
    np.testing.assert_allclose(train.images[3, 0, 0, 0], 120 / 255, rtol=1e-6)  # PNG pixels, as the .npy's
    assert [e["path"] for e in data_entries(cfg.data)] == [str(path)]  # a resume notices a changed JSONL
    with pytest.raises(DataError, match=r"images are \(8, 8, 1\).*image_size and image_channels"):
        make_dataset(cfg.data, split="train", **{**kw, "image_shape": (4, 4, 1)})
    bad = _write_examples(tmp_path, [{"image": "im0.npy", "prompt": "p"}])
    with pytest.raises(DataError, match=r"examples.jsonl:1: each line is an object with string keys"):
        make_dataset(make_config({"model_type": "vlm", "dataset_type": "image_text",
                                  "dataset_path": str(bad)}).data, split="train", **kw)


def test_vqa_chance_is_the_best_constant_answer_per_type_averaged_over_questions():
    examples = [Example(i, "q", a, k) for i, (k, a) in enumerate(
        [("digit", "1"), ("digit", "1"), ("digit", "2"), ("digit", "3"),  # best: "1", 2 of 4
         ("parity", "odd"), ("parity", "odd"), ("parity", "odd"), ("parity", "even"),  # 3 of 4
         ("caption", "x"), ("caption", "y")])]  # 1 of 2
    assert vqa_chance(examples) == pytest.approx((2 + 3 + 1) / 10)


def test_an_answer_is_right_only_when_its_bytes_and_its_end_match():
    assert exact_match(np.frombuffer(b"7\nxx", np.uint8).astype(np.int32), "7")
    assert not exact_match(np.frombuffer(b"77\n", np.uint8).astype(np.int32), "7")
    assert not exact_match(np.frombuffer(b"7", np.uint8).astype(np.int32), "7")


def test_the_greedy_decoder_is_compiled_once_per_model_and_answer_length():
    """The federated server scores VQA every round with the same model: each round must reuse the
    jitted decoder (an equal model built again included), not trace and compile a new one."""
    from nvfp4_jax.train import vqa
    from nvfp4_jax.train.build import build_model

    m = make_config({"model_type": "vlm", "model_name": "tiny", "dataset_type": "digits",
                     "quantization": "te_nvfp4"}).model
    first = vqa._decoder(build_model(m), 4)
    assert vqa._decoder(build_model(m), 4) is first  # the next round's model
    assert vqa._decoder(build_model(m), 5) is not first
