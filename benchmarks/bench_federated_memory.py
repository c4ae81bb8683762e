"""The server's aggregation memory: FLARE's in-memory FedAvg sum vs `--disk-offload`'s sum on disk.

One point is one round of FedAvg aggregation on the server, in a fresh process: `sites` float32
updates of `mb` MB each (leaves of 4 MB) arrive one after another, as FLARE's FedAvg delivers
them (in time: each result is aggregated when it arrives, then dropped), and the mean is taken.
`memory` is FLARE's `WeightedAggregationHelper` (what FedAvg uses without a custom aggregator),
`disk` is `nvfp4_jax.federated.disk_aggregation.DiskWeightedAggregator` (what `--disk-offload`
gives FedAvg), its files in a temporary directory on the repository's file system. Measured above
the process's memory before the round:
- `peak_traced_mb`: the peak of numpy's allocations (tracemalloc), the arriving update included;
- `peak_rss_anon_mb` / `peak_rss_file_mb`: the peaks of /proc/self/status RssAnon / RssFile,
  sampled every 0.5 ms by a thread (the memory-mapped sum shows up as file pages, which the
  kernel can write back and drop; anonymous memory it cannot).
Each point is repeated in `--repeats` fresh processes; the rows give the median and the range.

    .venv/bin/python benchmarks/bench_federated_memory.py [--sites 2,4,8] [--mb 16,64] [--repeats 3]

Writes benchmarks/results/federated_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEAF_BYTES = 4 << 20
MODES = ("memory", "disk")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class _Sampler(threading.Thread):
    """The peaks of RssAnon and RssFile while it runs."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0.0, "RssFile": 0.0}
        self._done = threading.Event()

    def run(self):
        while not self._done.is_set():
            for field in self.peak:
                self.peak[field] = max(self.peak[field], _status_mb(field))
            time.sleep(0.0005)

    def stop(self) -> dict:
        self._done.set()
        self.join()
        for field in self.peak:  # the last state too
            self.peak[field] = max(self.peak[field], _status_mb(field))
        return self.peak


def point(mode: str, sites: int, mb: int) -> dict:
    """One round's aggregation in this process; memory above what the process held before it."""
    import numpy as np
    from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper

    sys.path.insert(0, str(ROOT))
    from nvfp4_jax.federated.disk_aggregation import DiskWeightedAggregator

    leaves = max(1, (mb << 20) // LEAF_BYTES)
    with tempfile.TemporaryDirectory(dir=ROOT) as root:
        aggregator = DiskWeightedAggregator(root=root) if mode == "disk" else WeightedAggregationHelper()
        before = {"RssAnon": _status_mb("RssAnon"), "RssFile": _status_mb("RssFile")}
        sampler = _Sampler()
        sampler.start()
        tracemalloc.start()
        t0 = time.perf_counter()
        for site in range(sites):
            # the arriving update: model-sized, in memory (FLARE deserialises it), dropped once added
            update = {f"leaf{i}": np.full(LEAF_BYTES // 4, site + 1, np.float32) for i in range(leaves)}
            aggregator.add(update, float(site + 1), f"site-{site + 1}") if mode == "disk" else aggregator.add(
                data=update, weight=float(site + 1), contributor_name=f"site-{site + 1}", contribution_round=0)
            del update
        mean = aggregator.mean() if mode == "disk" else aggregator.get_result()
        seconds = time.perf_counter() - t0
        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        peak = sampler.stop()
        expected = sum((s + 1) ** 2 for s in range(sites)) / sum(s + 1 for s in range(sites))
        assert all(np.allclose(v, expected) for v in mean.values())
        disk_bytes = aggregator.bytes_on_disk if mode == "disk" else 0
    return {"mode": mode, "sites": sites, "model_mb": mb, "seconds": seconds,
            "peak_traced_mb": traced / 2**20, "disk_mb": disk_bytes / 2**20,
            "peak_rss_anon_mb": peak["RssAnon"] - before["RssAnon"],
            "peak_rss_file_mb": peak["RssFile"] - before["RssFile"]}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", default="2,4,8")
    ap.add_argument("--mb", default="16,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "federated_memory.json"))
    ap.add_argument("--point", nargs=3, metavar=("MODE", "SITES", "MB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:  # the child process: one point, its JSON on the last line
        mode, sites, mb = args.point
        print(json.dumps(point(mode, int(sites), int(mb))))
        return

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import nvflare
    from _harness import in_fresh_process
    from _report import write_result

    sites_list = [int(s) for s in args.sites.split(",")]
    mb_list = [int(m) for m in args.mb.split(",")]
    samples: dict[tuple, list[dict]] = {}
    for r in range(args.repeats):  # interleaved: load from other jobs hits every point alike
        for mb in mb_list:
            for sites in sites_list:
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    samples.setdefault((mode, sites, mb), []).append(
                        in_fresh_process(__file__, ["--point", mode, str(sites), str(mb)], timeout=300))
    rows = []
    print(f"{'mode':<7} {'sites':>5} {'MB':>4} {'traced MB':>18} {'RssAnon MB':>18} {'RssFile MB':>18} {'disk MB':>8} {'s':>6}")
    for (mode, sites, mb), runs in samples.items():
        row = {"mode": mode, "sites": sites, "model_mb": mb, "repeats": len(runs),
               "disk_mb": runs[0]["disk_mb"]}
        for key in ("peak_traced_mb", "peak_rss_anon_mb", "peak_rss_file_mb", "seconds"):
            row[key] = _spread([run[key] for run in runs])
        rows.append(row)

        def cell(key):
            s = row[key]
            return f"{s['median']:.1f} [{s['min']:.1f},{s['max']:.1f}]"

        print(f"{mode:<7} {sites:>5} {mb:>4} {cell('peak_traced_mb'):>18} {cell('peak_rss_anon_mb'):>18} "
              f"{cell('peak_rss_file_mb'):>18} {row['disk_mb']:>8.1f} {row['seconds']['median']:>6.2f}")
    write_result(Path(args.out), {"benchmark": "federated_memory", "sites": sites_list, "model_mb": mb_list,
                                  "repeats": args.repeats},
                 nvflare=nvflare.__version__,
                 note=("One round of FedAvg aggregation on the server, in a fresh process per repeat: "
                       "float32 updates in 4 MB leaves arrive one at a time (FLARE 2.9's FedAvg aggregates "
                       "each in time) and the mean is taken. memory = FLARE's WeightedAggregationHelper, "
                       "disk = DiskWeightedAggregator (--disk-offload). Peaks are above the process's "
                       "memory before the round and include the arriving update (model-sized) and the "
                       "new mean (model-sized); median [min, max] over the repeats."),
                 rows=rows)


if __name__ == "__main__":
    main()
