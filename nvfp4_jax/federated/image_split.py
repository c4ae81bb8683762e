"""Site data of a federated VLM: scikit-learn's digits split between the sites, non-IID under a
Dirichlet prior over the digit classes and over the task mix.

- Images: only the training split's (`image_batches.split_images` with the run's `seed` and
  `eval_fraction`, the split the server's held-out VQA and validation loss use), so no site
  holds an image the server evaluates on, nor one with the same pixels. Each digit class's
  training images go to the sites in proportions drawn from `Dirichlet(alpha)`
  (`split.dirichlet_split`, as the text corpus's plays by genre); every site gets at least one.
- Tasks: each site draws its task mix `w ~ Dirichlet(alpha)` over the question types
  (`digits.KINDS`), and keeps an image's example of type `k` with probability `w_k / max(w)`:
  its commonest type on every image, the others as its mix says. A large alpha keeps almost
  every example everywhere (close to IID), a small one leaves a site mostly one task.

Each site's data is a folder in the `dataset_type=image_text` format (`data/image_text.py`),
which the site trains on: `examples.jsonl` (`{"image", "prompt", "answer", "type"}` a line)
and `images/<index>.npy` (the float32 pixels, exactly the digits' own).
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np

from nvfp4_jax.data import digits
from nvfp4_jax.data.image_batches import Example, split_images
from nvfp4_jax.federated.split import dirichlet_split

EXAMPLES_FILE = "examples.jsonl"
# Keeps the task-mix draws apart from the class split's of the same seed.
_TASK_STREAM = 11


def split_examples(labels: np.ndarray, train_ids: np.ndarray, num_sites: int, alpha: float,
                   seed: int) -> list[list[Example]]:
    """Each site's examples: the training images `train_ids` (indices into `labels`) dealt out by
    class, then each site's examples thinned to its task mix (both Dirichlet(alpha))."""
    classes = [int(labels[i]) for i in train_ids]
    sites = dirichlet_split(classes, num_sites, alpha, seed, unit="training images")
    rng = np.random.default_rng([seed & (2**64 - 1), _TASK_STREAM])
    out = []
    for members in sites:
        mix = rng.dirichlet([alpha] * len(digits.KINDS))
        keep = mix / mix.max()
        own = []
        for j in members:
            image = int(train_ids[j])
            draws = rng.random(len(digits.KINDS))
            own.extend(e for e, d, p in zip(digits.examples_of(image, int(labels[image])), draws, keep)
                       if d < p)  # the commonest type (p = 1) always
        out.append(own)
    return out


def write_examples(folder: str, images: np.ndarray, examples) -> str:
    """`examples` (digits Examples) as an image_text folder (`EXAMPLES_FILE` and `images/`, one
    .npy per image they show); returns the JSONL's path."""
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    for image in sorted({e.image for e in examples}):
        np.save(os.path.join(folder, "images", f"{image}.npy"), images[image])
    path = os.path.join(folder, EXAMPLES_FILE)
    with open(path, "w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps({"image": f"images/{e.image}.npy", "prompt": e.prompt, "answer": e.answer,
                                "type": e.kind}) + "\n")
    return path


def write_site_images(directory: str, num_sites: int, alpha: float, seed: int, eval_fraction: float) -> list[dict]:
    """Writes each site's folder `site-<i>/` (examples.jsonl, images/) into `directory` from the
    digits' training split; returns what each holds (its path, images, examples, classes, tasks)."""
    images, labels = digits.load_images()
    train_ids = split_images(images, eval_fraction, seed)["train"]
    holdings = []
    for i, examples in enumerate(split_examples(labels, train_ids, num_sites, alpha, seed), start=1):
        path = write_examples(os.path.join(directory, f"site-{i}"), images, examples)
        shown = sorted({e.image for e in examples})
        holdings.append({
            "site": f"site-{i}", "path": path, "images": len(shown), "examples": len(examples),
            "classes": dict(sorted(collections.Counter(int(labels[j]) for j in shown).items())),
            "tasks": dict(sorted(collections.Counter(e.kind for e in examples).items())),
        })
    return holdings
