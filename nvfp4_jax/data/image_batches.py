"""Step-indexed batches of image-text examples for the VLM (`dataset_type=digits|image_text`).

An example is one image and one (prompt, answer) pair, of a question type (`kind`: e.g. `digit`,
`parity`, `caption`). Its text row is byte tokens: `prompt + " "` then `answer + "\\n"` (the
newline ends an answer, so greedy decoding knows where to stop). `inputs` is the row without its
last token, `targets` without its first, and the loss mask (`targets_segmentation`, 1 or 0)
counts only the targets that are answer tokens. Rows are padded with 0 (segment 0).

Held-out split: the images are grouped by their pixels (identical images form one group, so a
duplicate can never sit on both sides), the groups are permuted by the seed, and the first
`eval_fraction` of the images, in whole groups, are `eval`; every example of an image lies in its
image's split. `batch(step)` draws its examples by `np.random.default_rng([seed, split, step])`:
a pure function of the step, as `batches.StepBatches` asks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import NamedTuple, Sequence

import numpy as np

from nvfp4_jax.data.batches import Split
from nvfp4_jax.data.errors import DataError
from nvfp4_jax.data.packing import BATCH_KEYS, process_rows

PROMPT_END = " "
ANSWER_END = "\n"
SPLITS = {"train": 0, "eval": 1}
# Keeps the image split's permutation apart from the batches' draws of the same seed.
_SPLIT_STREAM = 7


class Example(NamedTuple):
    image: int  # index into the source's images
    prompt: str
    answer: str
    kind: str  # the question type (vqa_chance is per type)


def prompt_ids(prompt: str) -> np.ndarray:
    return np.frombuffer((prompt + PROMPT_END).encode("utf-8"), np.uint8).astype(np.int32)


def answer_ids(answer: str) -> np.ndarray:
    return np.frombuffer((answer + ANSWER_END).encode("utf-8"), np.uint8).astype(np.int32)


def text_row(example: Example, length: int) -> dict[str, np.ndarray]:
    """The batch contract's row (`packing.BATCH_KEYS`, int32[length] each) of `example`."""
    p, a = prompt_ids(example.prompt), answer_ids(example.answer)
    full = np.concatenate([p, a])
    n = len(full) - 1
    if n > length:
        raise DataError(f"the example {example.prompt!r} -> {example.answer!r} is {n} tokens, longer than "
                        f"the {length} text tokens a row holds (max_target_length - image tokens)")
    row = {key: np.zeros(length, np.int32) for key in BATCH_KEYS}
    row["inputs"][:n], row["targets"][:n] = full[:-1], full[1:]
    row["inputs_segmentation"][:n] = 1
    row["inputs_position"][:n] = np.arange(n)
    row["targets_segmentation"][len(p) - 1:n] = 1  # the targets that are answer tokens
    return row


def pixel_hash(image: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(image, np.float32).tobytes()).hexdigest()


def split_images(images_NxSxSxC: np.ndarray, eval_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """{"train": image indices, "eval": image indices}, sorted: whole groups of identical images,
    permuted by `seed`, until `eval_fraction` of the images are held out (at least one group)."""
    groups: dict[str, list[int]] = {}
    for i, image in enumerate(images_NxSxSxC):
        groups.setdefault(pixel_hash(image), []).append(i)
    ordered = list(groups.values())
    if len(ordered) < 2:
        raise DataError(f"{len(images_NxSxSxC)} images with {len(ordered)} distinct one(s): a held-out "
                        "split needs at least two distinct images")
    order = np.random.default_rng([seed & (2**64 - 1), _SPLIT_STREAM]).permutation(len(ordered))
    target = max(1, int(len(images_NxSxSxC) * eval_fraction))
    held: list[int] = []
    for g in order:
        if len(held) >= target or len(held) + len(ordered[g]) >= len(images_NxSxSxC):
            break
        held.extend(ordered[g])
    held_set = set(held)
    return {"train": np.array([i for i in range(len(images_NxSxSxC)) if i not in held_set], np.int64),
            "eval": np.array(sorted(held), np.int64)}


@dataclasses.dataclass(frozen=True, eq=False)
class ImageTextBatches(Split):
    """Batches of one split of image-text examples. `images` holds every image of the source
    (float32 `[N, S, S, C]`), `image_ids` this split's, `examples` this split's examples."""

    images: np.ndarray
    image_ids: np.ndarray
    examples: tuple[Example, ...]
    warnings: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Text tokens in the split's rows (FedAvg's data weight)."""
        return sum(len(prompt_ids(e.prompt)) + len(answer_ids(e.answer)) - 1 for e in self.examples)

    def describe(self) -> str:
        kinds = sorted({e.kind for e in self.examples})
        return (f"{self.name} {self.split}: {len(self.examples):,} examples ({', '.join(kinds)}) of "
                f"{len(self.image_ids):,} images")

    def rows(self, examples: Sequence[Example]) -> dict[str, np.ndarray]:
        """The batch of `examples`: the text rows' keys and `images` (float32 `[B, S, S, C]`)."""
        rows = [text_row(e, self.seq_len) for e in examples]
        batch = {key: np.stack([r[key] for r in rows]) for key in BATCH_KEYS}
        batch["images"] = self.images[[e.image for e in examples]]
        return batch

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        rng = np.random.default_rng([self.seed & (2**64 - 1), SPLITS[self.split], step])
        picks = rng.integers(0, len(self.examples), size=self.global_batch_size)
        own = process_rows(self.global_batch_size, process_index, process_count)
        return self.rows([self.examples[i] for i in picks[own.start:own.stop]])


def make_image_batches(name: str, images_NxSxSxC: np.ndarray, examples: Sequence[Example], *, split: str,
                       eval_fraction: float, image_shape: tuple[int, int, int], **common) -> ImageTextBatches:
    """The `split` of `examples` over `images` (float32 `[N, S, S, C]`), split by image. Raises
    DataError when the images are not `image_shape` (image_size, image_size, image_channels) or an
    example does not fit a row."""
    if split not in SPLITS:
        raise DataError(f"split={split!r}: choose one of {list(SPLITS)}.")
    if tuple(images_NxSxSxC.shape[1:]) != tuple(image_shape):
        raise DataError(f"{name}: images are {tuple(images_NxSxSxC.shape[1:])} (height, width, channels), "
                        f"but the model reads {tuple(image_shape)}: set image_size and image_channels to match")
    ids = split_images(images_NxSxSxC, eval_fraction, common["seed"])[split]
    members = set(ids.tolist())
    own = tuple(e for e in examples if e.image in members)
    if not own:
        raise DataError(f"{name}: the {split} split's {len(ids)} images have no examples")
    batches = ImageTextBatches(name=name, split=split, images=images_NxSxSxC.astype(np.float32), image_ids=ids,
                               examples=own, **common)
    for e in own:  # every example fits a row: a bad one fails now, not at some step
        text_row(e, batches.seq_len)
    return batches
