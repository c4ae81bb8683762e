"""The user's own image-text examples (`dataset_type=image_text`): a JSONL file at `dataset_path`,
one example per line, `{"image": path, "prompt": str, "answer": str}` and optionally `"type"` (the
question type, default "qa"); and `image_source`, which opens either image dataset type. Image paths are relative to the JSONL's folder: `.npy` arrays
(`[S, S]` or `[S, S, C]`; integer pixels are divided by 255, floats kept) or PNG files (Pillow, the
`vision` extra). Every image the file names is read once, in first-mention order.
"""

from __future__ import annotations

import json
import os

import numpy as np

from nvfp4_jax.config import DataConfig
from nvfp4_jax.data import digits
from nvfp4_jax.data.errors import DataError, require
from nvfp4_jax.data.image_batches import Example


def image_source(data_cfg: DataConfig) -> tuple[str, np.ndarray, tuple[Example, ...]]:
    """(name, float32 `[N, S, S, C]` images, examples) of `dataset_type=digits|image_text`."""
    if data_cfg.dataset_type == "digits":
        images, labels = digits.load_images()
        return "scikit-learn digits", images, digits.digit_examples(labels)
    images, examples = read_examples(data_cfg.dataset_path)
    return data_cfg.dataset_path, images, examples


def read_image(path: str) -> np.ndarray:
    """float32 `[S, S, C]` pixels of a .npy or .png file."""
    if not os.path.isfile(path):
        raise DataError(f"image {path!r} does not exist or is not a file")
    if path.lower().endswith(".npy"):
        pixels = np.load(path, allow_pickle=False)
    elif path.lower().endswith(".png"):
        image = require("PIL.Image", "PNG images", extra="vision")
        with image.open(path) as png:
            pixels = np.asarray(png)
    else:
        raise DataError(f"image {path!r}: read .npy arrays or .png files")
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    if pixels.ndim != 3:
        raise DataError(f"image {path!r} has shape {pixels.shape}: expected (height, width) or (height, width, channels)")
    if np.issubdtype(pixels.dtype, np.integer):
        return pixels.astype(np.float32) / 255.0
    return pixels.astype(np.float32)


def read_examples(jsonl_path: str) -> tuple[np.ndarray, tuple[Example, ...]]:
    """(float32 `[N, S, S, C]` images, the examples) of a JSONL file."""
    jsonl_path = os.path.expanduser(jsonl_path)
    if not os.path.isfile(jsonl_path):
        raise DataError(f"dataset_type='image_text': dataset_path {jsonl_path!r} does not exist or is not a file")
    folder = os.path.dirname(os.path.abspath(jsonl_path))
    index: dict[str, int] = {}
    images, examples = [], []
    with open(jsonl_path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{jsonl_path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("image", "prompt", "answer")):
                raise DataError(f"{where}: each line is an object with string keys image, prompt and answer")
            path = os.path.join(folder, row["image"])
            if path not in index:
                index[path] = len(images)
                images.append(read_image(path))
                if images[-1].shape != images[0].shape:
                    raise DataError(f"{where}: image {row['image']!r} is {images[-1].shape}, the first "
                                    f"image {images[0].shape}: every image has one shape")
            examples.append(Example(index[path], row["prompt"], row["answer"], str(row.get("type", "qa"))))
    if not examples:
        raise DataError(f"{jsonl_path}: no examples")
    return np.stack(images), tuple(examples)
