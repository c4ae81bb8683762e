"""This tree's train step against another revision's, interleaved step by step in one run.

    git archive fb5f34b | tar -x -C /tmp/nvfp4-base     # the revision to compare with
    python benchmarks/bench_step_vs_revision.py --baseline /tmp/nvfp4-base --baseline-revision fb5f34b \\
        [--variants scanned:scan_layers=true unrolled:scan_layers=false] \\
        [--presets tiny,small-25m] [--recipes bf16,te_nvfp4] [--out PATH]

Two packages named nvfp4_jax cannot share a process, so each revision (and each variant of this
tree: config overrides) runs in its own worker process that builds its cases with its own
package and benchmark harness (`_harness.StepCase`: the real jitted train step on one device
and a fixed synthetic batch), then waits. The parent asks one worker at a time for one step of
one case, rotating the order every round, so machine load hits every revision alike; nothing
else runs while a step is timed. A case's time is the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from _report import write_result  # noqa: E402
from _workers import Worker  # noqa: E402

OUT = HERE / "results" / "step_vs_revision.json"
SHAPES = {"tiny": (8, 128), "small-25m": (2, 256)}  # (batch, seq) as bench_step.py


def worker(root: str, cases: list[str], overrides: dict[str, str]) -> None:
    """Builds `preset/recipe` cases from the package under `root`; then one step per stdin line."""
    sys.path[:0] = [root, os.path.join(root, "benchmarks")]
    import jax
    from _harness import StepCase
    from nvfp4_jax import sharding
    from nvfp4_jax.config import MeshConfig, make_config
    from nvfp4_jax.train.build import build_model

    mesh = sharding.make_mesh(MeshConfig(ici_fsdp_parallelism=1), devices=jax.devices()[:1])
    built = {}
    for case in cases:
        preset, recipe = case.split("/")
        batch, seq = SHAPES[preset]
        cfg = make_config({"model_name": preset, "quantization": recipe, "per_device_batch_size": batch,
                           "max_target_length": seq, "dataset_type": "synthetic", "steps": 10_000,
                           **overrides})
        built[case] = StepCase(cfg, mesh, build_model(cfg.model))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        case = line.strip()
        built[case].run()
        print(json.dumps({"case": case, "s": built[case].times[-1], "loss": built[case].loss,
                          "first_step_s": built[case].first_step_s}), flush=True)


def _worker(name: str, root: str, cases: list[str], overrides: dict[str, str]) -> Worker:
    return Worker(name, root, __file__, ["--worker", root, "--cases", ",".join(cases),
                                         "--overrides", json.dumps(overrides)])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="root of the revision to compare with (a git archive)")
    ap.add_argument("--baseline-revision", help="the commit that root was archived from (recorded)")
    ap.add_argument("--variants", nargs="*", default=["now:"],
                    help="NAME:key=value,... config overrides for this tree, one worker each")
    ap.add_argument("--presets", default="tiny,small-25m")
    ap.add_argument("--recipes", default="bf16,te_nvfp4")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", default="tiny=30,small-25m=12", help="rounds per preset")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.cases.split(","), json.loads(args.overrides))
        return {}

    t0 = time.perf_counter()
    presets = [p for p in args.presets.split(",") if p]
    recipes = [r for r in args.recipes.split(",") if r]
    repeats = {k: int(v) for k, v in (kv.split("=") for kv in args.repeats.split(","))}
    this_tree = str(HERE.parent)
    revisions = [("baseline", args.baseline, {})] if args.baseline else []
    for variant in args.variants:
        name, _, spec = variant.partition(":")
        revisions.append((name, this_tree, dict(kv.split("=", 1) for kv in spec.split(",") if kv)))
    overrides_by_name = {name: overrides for name, _, overrides in revisions}
    result_rows = []
    for preset in presets:
        cases = [f"{preset}/{r}" for r in recipes]
        workers = [_worker(name, root, cases, overrides) for name, root, overrides in revisions]
        times = {(w.name, c): [] for w in workers for c in cases}
        info = {}
        slots = [(w, c) for c in cases for w in workers]
        for round_ in range(args.warmup + repeats.get(preset, 10)):
            k = round_ % len(slots)
            for w, case in slots[k:] + slots[:k]:
                got = w.ask(case)
                info[(w.name, case)] = got
                if round_ >= args.warmup:
                    times[(w.name, case)].append(got["s"])
        for w in workers:
            w.close()
        for (name, case), ts in times.items():
            base = times.get(("baseline", case))
            row = dict(preset=preset, recipe=case.split("/")[1], revision=name,
                       overrides=overrides_by_name[name],
                       median_step_s=round(statistics.median(ts), 5), min_step_s=round(min(ts), 5),
                       ratio_to_baseline=round(statistics.median(ts) / statistics.median(base), 3) if base else None,
                       first_step_s=round(info[(name, case)]["first_step_s"], 2),
                       last_loss=round(info[(name, case)]["loss"], 4), times_s=[round(t, 4) for t in ts])
            result_rows.append(row)
            ratio = "" if row["ratio_to_baseline"] is None else f"{row['ratio_to_baseline']:.3f}"
            print(f"{preset:10s} {row['recipe']:24s} {name:10s} median {row['median_step_s']:.4f} s "
                  f"min {row['min_step_s']:.4f} s  / baseline {ratio:>6s}  1st step {row['first_step_s']:.1f} s",
                  flush=True)
    command = "python " + " ".join([os.path.relpath(__file__, Path.cwd())] + list(argv or sys.argv[1:]))
    return write_result(
        args.out, dict(command=command),
        baseline=args.baseline, baseline_revision=args.baseline_revision,
        wall_s=round(time.perf_counter() - t0, 1),
        note="median of interleaved rounds after warm-up, one worker process per revision, one "
        "device, fixed synthetic batch; first_step_s includes compilation",
        rows=result_rows,
    )


if __name__ == "__main__":
    main()
