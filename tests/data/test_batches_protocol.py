"""Every data source implements the one step-indexed protocol (`data.batches.StepBatches`)."""

import numpy as np
import pytest

from nvfp4_jax.config import make_config
from nvfp4_jax.data import StepBatches, make_dataset
from nvfp4_jax.data.batches import Split
from nvfp4_jax.data.documents import DocumentBatches
from nvfp4_jax.data.image_batches import ImageTextBatches
from nvfp4_jax.data.packing import BATCH_KEYS
from nvfp4_jax.data.streams import TokenBatches

MEMBERS = [name for name in dir(StepBatches) if not name.startswith("_")] + list(StepBatches.__annotations__)


@pytest.mark.parametrize("cls", [TokenBatches, DocumentBatches, ImageTextBatches])
def test_each_source_class_has_every_member_of_the_protocol_and_the_shared_split_fields(cls):
    assert issubclass(cls, Split)
    fields = {f.name for f in cls.__dataclass_fields__.values()}
    missing = [m for m in MEMBERS if not hasattr(cls, m) and m not in fields]
    assert not missing, missing


@pytest.mark.parametrize("dataset_type", ["shakespeare", "synthetic"])
def test_a_batch_is_a_pure_function_of_the_step_in_the_batch_contract(dataset_type):
    cfg = make_config({"dataset_type": dataset_type})
    data = make_dataset(cfg.data, seq_len=16, global_batch_size=4, seed=3, split="train", vocab_size=256)
    again = make_dataset(cfg.data, seq_len=16, global_batch_size=4, seed=3, split="train", vocab_size=256)
    for step in (0, 7):
        a, b = data.batch(step), again.batch(step)
        assert set(a) <= set(BATCH_KEYS) and a["inputs"].shape == (4, 16)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(data.batch(0)["inputs"], data.batch(1)["inputs"])
    # Two processes' rows are the global batch's halves.
    halves = [data.batch(5, process_index=i, process_count=2)["inputs"] for i in (0, 1)]
    np.testing.assert_array_equal(np.concatenate(halves), data.batch(5)["inputs"])
