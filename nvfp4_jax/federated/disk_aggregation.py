"""FedAvg's weighted mean with its running sum on disk: what `--disk-offload` turns on.

FLARE's in-memory aggregation (`WeightedAggregationHelper`) keeps a model-sized running sum in
the server's memory for the round. `DiskWeightedAggregator` (a FLARE `ModelAggregator`, given to
FedAvg as its `aggregator`) keeps it in memory-mapped files instead, one per leaf, in a directory
of its own under `root` that exists only during the round. Each arriving update is added leaf by
leaf in chunks of at most `chunk_bytes`, so the only anonymous memory the sum costs is one chunk;
`aggregate_model` divides by the summed weights into the new (in-memory) mean and removes the
directory.

The arithmetic is FLARE's, element by element and in arrival order (`sum = v * w`, then
`sum = sum + v * w`, then `sum * (1 / total_weight)`, each in the dtype numpy gives `v * w`), so the
mean is bit-identical to `WeightedAggregationHelper`'s for the same results in the same order
(`tests/federated/test_disk_aggregation.py`). The weight is FedAvg's: the result's
`NUM_STEPS_CURRENT_ROUND` (`BudgetedFedAvg` sets it from its `weighting`). jax-free: the FLARE
server imports it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import numpy as np
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.aggregators.model_aggregator import ModelAggregator

CHUNK_BYTES = 4 << 20


class DiskWeightedAggregator(ModelAggregator):
    def __init__(self, root: str = "", chunk_bytes: int = CHUNK_BYTES):
        super().__init__()
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be at least 1")
        self.root = root  # empty: the system's temporary directory
        self.chunk_bytes = chunk_bytes
        self.directory: str | None = None  # this round's files; None between rounds
        self.bytes_on_disk = 0  # the round's running sum, as the files' sizes on disk
        self.last_round_bytes = 0  # the last aggregated round's bytes_on_disk
        self._leaves: dict[str, tuple[str, tuple, np.dtype]] = {}  # key -> file, shape, dtype
        self._weights: dict[str, float] = {}
        self._params_type = None
        self.contributors: list[str] = []
        # FLARE may deliver two sites' results on two threads: one update is added at a time
        # (a sum's chunk is read, added to and written back), as WeightedAggregationHelper locks.
        self._lock = threading.RLock()

    # --- FLARE's ModelAggregator --------------------------------------------------------

    def reset_stats(self):
        with self._lock:
            self._reset()

    def _reset(self):
        self._remove()
        self._leaves, self._weights, self._params_type, self.contributors = {}, {}, None, []
        self.bytes_on_disk = 0

    def accept_model(self, model: FLModel):
        meta = model.meta or {}
        weight = meta.get(FLMetaKey.NUM_STEPS_CURRENT_ROUND, 1.0)
        if self._params_type is None:
            self._params_type = model.params_type
        self.add(model.params, weight, str(meta.get("client_name") or meta.get(FLMetaKey.CLIENT_NAME, "?")))

    def aggregate_model(self) -> FLModel:
        with self._lock:
            model = FLModel(params=self._mean(), params_type=self._params_type)
            self._reset()
            return model

    # --- the sum on disk ----------------------------------------------------------------

    def add(self, params: dict, weight: float, contributor: str = "?") -> None:
        """Adds `weight * params` to the running sum, leaf by leaf, chunk by chunk."""
        with self._lock:
            self._add(params, weight, contributor)

    def _add(self, params: dict, weight: float, contributor: str) -> None:
        if self.directory is None:
            if self.root:
                os.makedirs(self.root, exist_ok=True)
            self.directory = tempfile.mkdtemp(prefix="nvfp4_jax_aggregation_", dir=self.root or None)
        for key, value in params.items():
            materialize = getattr(value, "materialize", None)  # FLARE's disk-offloaded lazy reference
            leaf = np.asarray(materialize() if callable(materialize) else value)
            if key in self._leaves:
                path, shape, dtype = self._leaves[key]
                if leaf.shape != shape:
                    raise ValueError(f"{contributor}'s {key} has shape {leaf.shape}, the round's sum {shape}")
                self._accumulate(path, shape, dtype, leaf, weight, first=False)
                self._weights[key] = self._weights[key] + weight
            else:
                dtype = np.result_type(leaf, weight)  # what `leaf * weight` gives (FLARE's sum)
                path = os.path.join(self.directory, f"{len(self._leaves)}.sum")
                self._leaves[key] = (path, leaf.shape, dtype)
                self._accumulate(path, leaf.shape, dtype, leaf, weight, first=True)
                self.bytes_on_disk += os.path.getsize(path)
                self._weights[key] = weight
        self.contributors.append(contributor)

    def _accumulate(self, path, shape, dtype, leaf, weight, *, first: bool) -> None:
        size = int(np.prod(shape, dtype=np.int64))
        if size == 0:
            open(path, "wb").close()
            return
        total = np.memmap(path, dtype=dtype, mode="w+" if first else "r+", shape=(size,))
        flat = leaf.reshape(-1)
        step = max(1, self.chunk_bytes // dtype.itemsize)
        product = np.empty(min(step, size), dtype)
        for start in range(0, size, step):
            stop = min(start + step, size)
            part = product[: stop - start]
            np.multiply(flat[start:stop], weight, out=part)
            if first:
                total[start:stop] = part
            else:
                np.add(total[start:stop], part, out=total[start:stop])
        total.flush()
        del total

    def mean(self) -> dict:
        """The weighted mean of what was added: each leaf's sum times 1 / its summed weight."""
        with self._lock:
            return self._mean()

    def _mean(self) -> dict:
        out = {}
        for key, (path, shape, dtype) in self._leaves.items():
            scale = 1.0 / self._weights[key]
            size = int(np.prod(shape, dtype=np.int64))
            result = np.empty(shape, np.result_type(np.empty(0, dtype), scale))
            if size:
                total = np.memmap(path, dtype=dtype, mode="r", shape=(size,))
                flat = result.reshape(-1)
                step = max(1, self.chunk_bytes // dtype.itemsize)
                for start in range(0, size, step):
                    np.multiply(total[start:start + step], scale, out=flat[start:start + step])
                del total
            out[key] = result
        self.last_round_bytes = self.bytes_on_disk
        return out

    def _remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
