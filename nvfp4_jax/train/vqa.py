"""The VLM's held-out question answering: greedy answers and their exact-match accuracy
(`vqa_accuracy` in summary.json), beside the best constant answer's (`vqa_chance`).

Every held-out example is answered once: its prompt after its image, then the model's most
likely byte, appended and fed back, up to the longest reference answer (with its end, "\\n").
An answer is right when its bytes up to and including the first "\\n" are the reference's.
`vqa_chance` gives each question type its most frequent held-out answer and counts how often
that constant is right: `sum over types of (count of the type's commonest answer) / examples`.
Both are also given per question type (`vqa_accuracy_by_type`, `vqa_chance_by_type`).
"""

from __future__ import annotations

import collections
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.data.image_batches import ANSWER_END, Example, ImageTextBatches, answer_ids, prompt_ids
from nvfp4_jax.quant import quant_rngs
from nvfp4_jax.train import build

# Examples answered per call of the jitted decoder (the last chunk is padded to it).
CHUNK = 256


def vqa_chance(examples: Sequence[Example]) -> float:
    """The accuracy of answering every question of a type with that type's commonest answer."""
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in examples:
        by_kind[e.kind][e.answer] += 1
    return sum(max(c.values()) for c in by_kind.values()) / max(len(examples), 1)


def exact_match(generated: np.ndarray, answer: str) -> bool:
    """Whether greedy bytes `generated` spell `answer` and then end it."""
    reference = answer_ids(answer)
    return len(generated) >= len(reference) and np.array_equal(generated[:len(reference)], reference)


@functools.lru_cache(maxsize=8)
def _decoder(model, steps: int):
    """jit: (variables, tokens_BxL, lengths_B, images, key) -> tokens with `steps` greedy bytes
    written from each row's `lengths` on. One per (model, steps): the federated server scores
    every round with the same model (Flax modules compare and hash by their fields), so it
    compiles the decoder once, not once a round."""

    def decode(variables, tokens_BxL, lengths_B, images_BxSxSxC, key):
        rows = jnp.arange(tokens_BxL.shape[0])

        def one(i, tokens_BxL):
            logits_BxLxV = model.apply(variables, tokens_BxL, images_BxSxSxC, rngs=quant_rngs(key))
            nxt_B = jnp.argmax(logits_BxLxV[rows, lengths_B + i - 1], axis=-1).astype(tokens_BxL.dtype)
            return tokens_BxL.at[rows, lengths_B + i].set(nxt_B)

        return jax.lax.fori_loop(0, steps, one, tokens_BxL)

    return jax.jit(decode)


def greedy_answers(model, variables, data: ImageTextBatches, examples: Sequence[Example], key) -> list[np.ndarray]:
    """Each example's greedy bytes after its prompt (as many as its longest reference answer)."""
    steps = max(len(answer_ids(e.answer)) for e in examples)
    decode = _decoder(model, steps)
    out: list[np.ndarray] = []
    for first in range(0, len(examples), CHUNK):
        chunk = list(examples[first:first + CHUNK])
        prompts = [prompt_ids(e.prompt) for e in chunk]
        # A row's bytes past seq_len are dropped (the scatter's default): they cannot match.
        tokens = np.zeros((CHUNK, data.seq_len), np.int32)
        lengths = np.ones(CHUNK, np.int32)
        for row, p in enumerate(prompts):
            tokens[row, :len(p)], lengths[row] = p, len(p)
        images = np.zeros((CHUNK,) + data.images.shape[1:], np.float32)
        images[:len(chunk)] = data.images[[e.image for e in chunk]]
        result = np.asarray(decode(variables, tokens, lengths, images, key))
        out.extend(result[row, lengths[row]:lengths[row] + steps] for row in range(len(chunk)))
    return out


def vqa_scores(model, state, data: ImageTextBatches) -> dict[str, float | int]:
    """`vqa_accuracy` (greedy exact match), `vqa_chance` and `vqa_questions` of `data`'s examples,
    answered by `model` (a VLM) with `state`'s parameters."""
    examples = data.examples
    variables = {"params": state.params, **state.fp8_meta}
    with build.backend_scope(model):
        answers = greedy_answers(model, variables, data, examples, state.rng)
    right = [exact_match(a, e.answer) for a, e in zip(answers, examples)]
    kinds = sorted({e.kind for e in examples})
    return {"vqa_accuracy": sum(right) / len(examples), "vqa_chance": vqa_chance(examples),
            "vqa_questions": len(examples),
            "vqa_accuracy_by_type": {k: float(np.mean([r for r, e in zip(right, examples) if e.kind == k]))
                                     for k in kinds},
            "vqa_chance_by_type": {k: vqa_chance([e for e in examples if e.kind == k]) for k in kinds}}


__all__ = ["ANSWER_END", "exact_match", "greedy_answers", "vqa_chance", "vqa_scores"]
