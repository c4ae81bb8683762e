"""Compile time of the train step against depth: scanned and unrolled layers, bf16 and te_nvfp4.

    python benchmarks/bench_compile.py [--layers 2,8,32] [--recipes bf16,te_nvfp4] [--out PATH]

For each depth, layout (`scan_layers=true|false`) and recipe, the real train step (`_harness.
StepCase`: `build_model`, `init_state`, `make_train_step` jitted with shardings and donated state)
is lowered (`.lower`: tracing to StableHLO), compiled (`.compile`: XLA) and run once (the first
step, waited for), each timed on its own. Widths are small (d_model 64, MLP 128, 2 heads of 32,
vocabulary 256, batch 2 x 32 tokens) so that compiling, not computing, is what is measured.
Each case runs in a fresh process, so no jit cache is shared between cases; `--rounds` passes
over all cases (default 2) spread machine load across them, and a case's time is its fastest.

The goal (issue 10): scanned compile time roughly flat in depth, 32 layers within 1.5x of 2.
Prints a table and writes JSON to `benchmarks/results/compile.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from _harness import in_fresh_process  # noqa: E402
from _report import environment, write_json  # noqa: E402

OUT = HERE / "results" / "compile.json"
GOAL_RATIO = 1.5  # scanned: 32 layers within 1.5x of 2 layers
SHAPE = dict(model_name="tiny", base_emb_dim=64, base_mlp_dim=128, base_num_query_heads=2,
             base_num_kv_heads=1, head_dim=32, vocab_size=256, max_target_length=32,
             per_device_batch_size=2, dataset_type="synthetic", steps=10_000)


def measure(layers: int, scan: bool, recipe: str) -> dict:
    """Lower, compile and first-step seconds of one configuration (in this process)."""
    import jax
    from _harness import StepCase
    from nvfp4_jax import sharding
    from nvfp4_jax.config import MeshConfig, make_config
    from nvfp4_jax.train.build import build_model

    cfg = make_config({**SHAPE, "base_num_decoder_layers": layers, "scan_layers": scan, "quantization": recipe})
    mesh = sharding.make_mesh(MeshConfig(ici_fsdp_parallelism=1), devices=jax.devices()[:1])
    case = StepCase(cfg, mesh, build_model(cfg.model))
    case.compile()
    case.run()
    return dict(layers=layers, scan_layers=scan, recipe=recipe, lower_s=round(case.lower_s, 2),
                compile_s=round(case.compile_s, 2), first_step_s=round(case.first_step_s, 3),
                lower_and_compile_s=round(case.lower_s + case.compile_s, 2), loss=round(case.loss, 4))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,8,32")
    ap.add_argument("--recipes", default="bf16,te_nvfp4")
    ap.add_argument("--layouts", default="scanned,unrolled")
    ap.add_argument("--rounds", type=int, default=2, help="passes over all cases; each case keeps its fastest")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--case", help=argparse.SUPPRESS)  # LAYERS,SCAN,RECIPE: measure in this process
    args = ap.parse_args(argv)
    if args.case:
        layers, scan, recipe = args.case.split(",")
        print(json.dumps(measure(int(layers), scan == "scanned", recipe)), flush=True)
        return {}

    t0 = time.perf_counter()
    cases = [(recipe, layout, int(layers)) for recipe in args.recipes.split(",")
             for layout in args.layouts.split(",") for layers in args.layers.split(",")]
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    print(f"{'round':5s} {'recipe':10s} {'layout':9s} {'layers':>6s} {'lower s':>8s} {'compile s':>9s} "
          f"{'1st step s':>10s} {'total s':>8s}", flush=True)
    for round_ in range(args.rounds):
        for recipe, layout, layers in cases:
            row = in_fresh_process(__file__, ["--case", f"{layers},{layout},{recipe}"])
            row["total_s"] = round(row["lower_and_compile_s"] + row["first_step_s"], 2)
            runs[(recipe, layout, layers)].append(row)
            print(f"{round_ + 1:5d} {recipe:10s} {layout:9s} {layers:6d} {row['lower_s']:8.2f} "
                  f"{row['compile_s']:9.2f} {row['first_step_s']:10.3f} {row['total_s']:8.2f}", flush=True)
    rows = []
    for case, got in runs.items():
        best = min(got, key=lambda r: r["total_s"])
        rows.append({**best, "totals_s": [r["total_s"] for r in got]})
    print("\nfastest of each case:")
    for r in rows:
        print(f"{r['recipe']:10s} {'scanned' if r['scan_layers'] else 'unrolled':9s} {r['layers']:6d} "
              f"lower {r['lower_s']:6.2f} s  compile {r['compile_s']:7.2f} s  first step {r['first_step_s']:6.3f} s"
              f"  total {r['total_s']:7.2f} s", flush=True)

    def total(recipe, scan, layers):
        r = next((r for r in rows if (r["recipe"], r["scan_layers"], r["layers"]) == (recipe, scan, layers)), None)
        return None if r is None else r["total_s"]

    depths = sorted({r["layers"] for r in rows})
    goal = {}
    for recipe in args.recipes.split(","):
        shallow, deep = total(recipe, True, depths[0]), total(recipe, True, depths[-1])
        if shallow and deep:
            goal[recipe] = dict(ratio=round(deep / shallow, 2), met=deep / shallow <= GOAL_RATIO)
            print(f"goal: scanned {recipe}, {depths[-1]} layers / {depths[0]} layers = {deep / shallow:.2f}x "
                  f"(<= {GOAL_RATIO}x: {'met' if goal[recipe]['met'] else 'not met'})")
    result = dict(
        command="python " + " ".join([os.path.relpath(__file__, Path.cwd())] + list(argv or sys.argv[1:])),
        **environment(),
        wall_s=round(time.perf_counter() - t0, 1),
        shape=SHAPE,
        note="each case in a fresh process, the fastest of --rounds passes (totals_s lists all); "
        "lower = trace to StableHLO, compile = XLA, first_step = the first execution; the goal "
        "ratio compares lower + compile + first step",
        goal=dict(scanned_deep_over_shallow_max=GOAL_RATIO, recipes=goal),
        rows=rows,
    )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
