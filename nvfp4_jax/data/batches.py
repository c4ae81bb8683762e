"""The one step-indexed protocol every data source implements, and the fields every split shares.

A source is a pure function of its files, its settings and the step: `batch(step)` is the same
arrays on every call, on every process, in every run of the same config, so that the data
position is the step a checkpoint records and a resume needs nothing else. The trainer, the
evaluator, the federated sites and the lab read data only through this protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """What every split of every source is: its name and split, row length, global batch size,
    seed and the vocabulary its ids lie in."""

    name: str
    split: str
    seq_len: int
    global_batch_size: int
    seed: int
    vocab_size: int

    # A split whose rows are drawn anywhere in it at every step (a source with epochs overrides
    # these): nothing to announce, and every requested eval batch exists.
    def notice(self, step: int) -> str | None:
        return None

    def eval_limit(self, steps: int) -> tuple[int, str | None]:
        return steps, None


class StepBatches(Protocol):
    """Batches of one split, indexed by step."""

    split: str
    seq_len: int
    global_batch_size: int
    warnings: tuple[str, ...]  # what a user should hear about that does not stop a run

    @property
    def num_tokens(self) -> int | None:
        """Tokens in the split (FedAvg's data weight); None for an unbounded source."""

    def describe(self) -> str:
        """One line saying what the split holds."""

    def notice(self, step: int) -> str | None:
        """A line to print when batch `step` starts something (an epoch), else None."""

    def eval_limit(self, steps: int) -> tuple[int, str | None]:
        """How many of `steps` eval batches exist, and a line saying so when fewer."""

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step`, in the batch contract (`packing.BATCH_KEYS`)."""
