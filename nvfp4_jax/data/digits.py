"""scikit-learn's handwritten digits (`sklearn.datasets.load_digits`: 1,797 8x8 grey images,
shipped inside the package, no download) as caption and question-answer examples
(`dataset_type=digits`, the `vision` extra).

Every image gives one example of each question type (`KINDS`):

    digit     "what digit is this?"        -> "7"
    parity    "is it even or odd?"         -> "odd"
    greater   "is it greater than 4?"      -> "yes"   (the threshold: `threshold(image index)`)
    caption   "caption:"                   -> "a handwritten seven"

Pixels are scaled from the dataset's 0..16 to [0, 1], shape `[1797, 8, 8, 1]`.
"""

from __future__ import annotations

import functools

import numpy as np

from nvfp4_jax.data.errors import require
from nvfp4_jax.data.image_batches import Example

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
KINDS = ("digit", "parity", "greater", "caption")


@functools.lru_cache(maxsize=1)
def load_images() -> tuple[np.ndarray, np.ndarray]:
    """(float32 `[N, 8, 8, 1]` in [0, 1], int64 `[N]` labels) of scikit-learn's digits."""
    datasets = require("sklearn.datasets", "dataset_type='digits'", extra="vision")
    digits = datasets.load_digits()
    images = (np.asarray(digits.images, np.float32) / 16.0)[..., None]
    images.setflags(write=False)
    return images, np.asarray(digits.target, np.int64)


def threshold(image: int) -> int:
    """The N of image `image`'s "is it greater than N?" (0..8, varying with the index)."""
    return (7 * image + 3) % 9


def examples_of(image: int, label: int) -> tuple[Example, ...]:
    """The four examples of one image whose digit is `label`."""
    n = threshold(image)
    return (
        Example(image, "what digit is this?", str(label), "digit"),
        Example(image, "is it even or odd?", "even" if label % 2 == 0 else "odd", "parity"),
        Example(image, f"is it greater than {n}?", "yes" if label > n else "no", "greater"),
        Example(image, "caption:", f"a handwritten {DIGIT_NAMES[label]}", "caption"),
    )


def digit_examples(labels: np.ndarray) -> tuple[Example, ...]:
    """Every image's examples, in image order."""
    return tuple(e for i, label in enumerate(labels.tolist()) for e in examples_of(i, label))
