"""Compile time of the train step against depth: scanned and unrolled layers, bf16 and te_nvfp4.

    python benchmarks/bench_compile.py [--layers 2,8,32] [--recipes bf16,te_nvfp4] [--out PATH]

For each depth, layout (`scan_layers=true|false`) and recipe, the real train step (`_harness.
StepCase`: `build_model`, `init_state`, `make_train_step` jitted with shardings and donated state)
is lowered (`.lower`: tracing to StableHLO), compiled (`.compile`: XLA) and run once (the first
step, waited for), each timed on its own. Widths are small (d_model 64, MLP 128, 2 heads of 32,
vocabulary 256, batch 2 x 32 tokens) so that compiling, not computing, is what is measured.
Each case runs in a fresh process, so no jit cache is shared between cases; `--rounds` passes
over all cases (default 2) spread machine load across them, and a case's time is its fastest.

The goal: scanned compile time roughly flat in depth, 32 layers within 1.5x of 2.
Prints a table and writes JSON to `benchmarks/results/compile.json`.

    python benchmarks/bench_compile.py --presets tiny,small-25m [--rounds 2] [--baseline DIR --baseline-revision REV]

The first step of the presets themselves (their own widths and depths, synthetic data), bf16
against te_nvfp4, scanned and unrolled: set-up (model and state init), lower, compile and first
execution, each timed in a fresh process, and te_nvfp4's first step (lower + compile + run) as a
multiple of bf16's beside it (goal: at most 1.5x on every supported JAX), and the compile time
of `jax.jit(quantize_nvfp4)` on a 32x64 tensor (goal: under 1 s). Writes
`benchmarks/results/compile_presets_jax<version>.json`, one file per JAX (run it from each leg's
environment). `--quantizer` measures only the quantizer's compile (`--rounds` fresh processes),
into `benchmarks/results/compile_quantizer_jax<version>.json`. `--diagnose hardware_factors,
constant_sr_keys` adds te_nvfp4 cases with one part of the quantizer's program replaced by a
cheaper stand-in with wrong bits (`DIAGNOSTICS`): upper bounds on what that part costs.
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


def _fastest_of_rounds(cases, rounds: int, run_case, key: str, show) -> list[dict]:
    """Each case measured once per round by `run_case(case)` (a fresh process; a round runs
    every case, so machine load spreads over all of them); per case the row with the smallest
    `key`, with every round's value under `key + "s"` ("total_s" -> "totals_s"). `show(round,
    case, row)` prints (and may complete) each row as it comes."""
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    for round_ in range(rounds):
        for case in cases:
            row = run_case(case)
            show(round_, case, row)
            runs[case].append(row)
    plural = key[:-2] + "s_s" if key.endswith("_s") else key + "s"
    return [{**min(got, key=lambda r: r[key]), plural: [r[key] for r in got]} for got in runs.values()]


PRESET_GOAL = 1.5  # te_nvfp4's first step at most 1.5x bf16's


# Diagnostics (`--diagnose`): te_nvfp4's first step with one part of the quantizer's program
# replaced by something cheaper that gives WRONG bits: upper bounds on what making that part
# cheaper could save, never results of the recipe.
DIAGNOSTICS = {
    "hardware_factors": "exact.div and exact.mul (the per-tensor factors' integer-built, correctly "
    "rounded arithmetic) replaced by float32 hardware division and multiplication",
    "constant_sr_keys": "every projection's stochastic-rounding key is PRNGKey(0) instead of its "
    "own key from the rng stream (no per-module key derivation in the program)",
}


def _apply_diagnostic(name: str) -> None:
    import jax
    import jax.numpy as jnp
    from nvfp4_jax.quant import exact, flax_dot

    if name == "hardware_factors":
        exact.div = lambda a, b: jnp.asarray(a, jnp.float32) / jnp.asarray(b, jnp.float32)
        exact.mul = lambda a, b: jnp.asarray(a, jnp.float32) * jnp.asarray(b, jnp.float32)
    elif name == "constant_sr_keys":
        flax_dot.QuantDotGeneral._sr_key = lambda self, recipe: jax.random.PRNGKey(0)
    else:
        raise ValueError(f"diagnostic {name!r}: not one of {', '.join(DIAGNOSTICS)}")


def measure_preset(preset: str, scan: bool, recipe: str, diagnostic: str = "") -> dict:
    """Set-up, lower, compile and first-step seconds of one preset's train step (this process),
    with `diagnostic` (a `DIAGNOSTICS` name) applied first when given."""
    import jax
    from _harness import StepCase
    from nvfp4_jax import sharding
    from nvfp4_jax.config import MeshConfig, make_config
    from nvfp4_jax.train.build import build_model

    if diagnostic:
        _apply_diagnostic(diagnostic)
    cfg = make_config({"model_name": preset, "scan_layers": scan, "quantization": recipe,
                       "dataset_type": "synthetic"})
    mesh = sharding.make_mesh(MeshConfig(ici_fsdp_parallelism=1), devices=jax.devices()[:1])
    t0 = time.perf_counter()
    case = StepCase(cfg, mesh, build_model(cfg.model))
    setup_s = time.perf_counter() - t0
    case.compile()
    case.run()
    first = case.lower_s + case.compile_s + case.first_step_s
    return dict(preset=preset, scan_layers=scan, recipe=recipe, diagnostic=diagnostic or None,
                layers=cfg.model.base_num_decoder_layers,
                setup_s=round(setup_s, 2), lower_s=round(case.lower_s, 2), compile_s=round(case.compile_s, 2),
                run_s=round(case.first_step_s, 3), first_step_s=round(first, 2), loss=round(case.loss, 4))


def measure_quantizer() -> dict:
    """Seconds to lower and compile `jax.jit(quantize_nvfp4)` of a 32x64 float32 tensor and of
    the per-tensor factors (this process: the first jit of the process is a warm-up)."""
    import jax
    import jax.numpy as jnp
    from nvfp4_jax.quant import nvfp4

    jax.jit(lambda a: a + 1).lower(jnp.float32(0)).compile()  # the process's first compile
    out = {}
    for name, fn, arg in [("quantize_nvfp4_32x64", nvfp4.quantize_nvfp4, jnp.zeros((32, 64), jnp.float32)),
                          ("tensor_factors", nvfp4.tensor_factors, jnp.float32(3.0))]:
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(arg)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        instructions = sum(" = " in line for line in compiled.as_text().splitlines())
        out[name] = dict(lower_s=round(t1 - t0, 3), compile_s=round(t2 - t1, 3), total_s=round(t2 - t0, 3),
                         stablehlo_lines=len(lowered.as_text().splitlines()), hlo_instructions=instructions)
    return out


def presets_main(args) -> dict:
    import jax

    t0 = time.perf_counter()
    quantizer = in_fresh_process(__file__, ["--quantizer-case"])
    print(f"jit(quantize_nvfp4) 32x64: {quantizer['quantize_nvfp4_32x64']['total_s']:.2f} s "
          f"(tensor_factors {quantizer['tensor_factors']['total_s']:.2f} s)", flush=True)
    # With --baseline, every case also runs from the baseline tree's own bench_compile.py, in the
    # same rounds (a round runs every case of both trees), so load hits both alike.
    head = environment()["package_revision"]
    trees = {head: __file__}
    if args.baseline:
        trees[args.baseline_revision or "baseline"] = str(Path(args.baseline) / "benchmarks" / "bench_compile.py")
    diagnostics = [d for d in (args.diagnose or "").split(",") if d]
    cases = [(rev, p, layout, r, "") for p in args.presets.split(",") for layout in args.layouts.split(",")
             for r in args.recipes.split(",") for rev in trees]
    # Diagnostics run from this tree only, beside its own cases.
    cases += [(head, p, layout, "te_nvfp4", d) for p in args.presets.split(",")
              for layout in args.layouts.split(",") for d in diagnostics]
    print(f"{'round':5s} {'revision':9s} {'preset':10s} {'layout':9s} {'recipe':9s} {'setup s':>8s} "
          f"{'lower s':>8s} {'compile s':>9s} {'run s':>7s} {'first step s':>12s}", flush=True)

    def show(round_, case, row):
        rev, preset, layout, recipe, diagnostic = case
        row["revision"] = rev
        recipe = f"{recipe}+{diagnostic}" if diagnostic else recipe
        print(f"{round_ + 1:5d} {rev:9s} {preset:10s} {layout:9s} {recipe:9s} {row['setup_s']:8.2f} "
              f"{row['lower_s']:8.2f} {row['compile_s']:9.2f} {row['run_s']:7.3f} {row['first_step_s']:12.2f}",
              flush=True)

    def run_case(case):
        rev, *rest = case
        return in_fresh_process(trees[rev], ["--preset-case", ",".join(v for v in rest if v)])

    rows = _fastest_of_rounds(cases, args.rounds, run_case, "first_step_s", show)
    ratios = []
    for rev in trees:
        for preset in args.presets.split(","):
            for layout in args.layouts.split(","):
                by = {r["recipe"]: r for r in rows if r["revision"] == rev and r["preset"] == preset
                      and r["scan_layers"] == (layout == "scanned") and not r.get("diagnostic")}
                if {"bf16", "te_nvfp4"} <= by.keys():
                    ratio = by["te_nvfp4"]["first_step_s"] / by["bf16"]["first_step_s"]
                    spread = [t / b for t in by["te_nvfp4"]["first_steps_s"] for b in by["bf16"]["first_steps_s"]]
                    ratios.append(dict(revision=rev, preset=preset, layout=layout,
                                       te_nvfp4_over_bf16=round(ratio, 2),
                                       range_over_rounds=[round(min(spread), 2), round(max(spread), 2)],
                                       met=ratio <= PRESET_GOAL))
                    print(f"{rev:9s} {preset:10s} {layout:9s} te_nvfp4 / bf16 first step = {ratio:.2f}x "
                          f"(rounds {min(spread):.2f}-{max(spread):.2f}x; goal <= {PRESET_GOAL}x: "
                          f"{'met' if ratio <= PRESET_GOAL else 'not met'})", flush=True)
    for row in rows:
        if row.get("diagnostic"):
            bf16 = next((r for r in rows if r["revision"] == row["revision"] and r["preset"] == row["preset"]
                         and r["scan_layers"] == row["scan_layers"] and r["recipe"] == "bf16"), None)
            if bf16 is not None:
                row["over_bf16"] = round(row["first_step_s"] / bf16["first_step_s"], 2)
                print(f"{row['revision']:9s} {row['preset']:10s} "
                      f"{'scanned' if row['scan_layers'] else 'unrolled':9s} te_nvfp4+{row['diagnostic']} / "
                      f"bf16 first step = {row['over_bf16']:.2f}x (a diagnostic: wrong bits)", flush=True)
    result = dict(
        command="python " + " ".join([os.path.relpath(__file__, Path.cwd())] + list(args.argv)),
        **environment(),
        wall_s=round(time.perf_counter() - t0, 1),
        note="each case in a fresh process (no jit cache shared), the fastest of --rounds passes "
        "(first_steps_s lists all); first_step = lower + compile + first execution; setup (model "
        "and optimizer-state init, compiled separately) is recorded beside it and not in the ratio",
        goal=dict(te_nvfp4_over_bf16_max=PRESET_GOAL, quantizer_compile_max_s=1.0),
        quantizer=quantizer,
        diagnostics={d: DIAGNOSTICS[d] for d in diagnostics},
        ratios=ratios,
        rows=rows,
    )
    out = args.out if args.out != OUT else HERE / "results" / f"compile_presets_jax{jax.__version__}.json"
    write_json(out, result)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", help="compare bf16 and te_nvfp4 first steps of these presets (e.g. tiny,small-25m)")
    ap.add_argument("--baseline", help="with --presets: also run every case from this tree (another "
                    "revision, e.g. `git archive REV | tar -x -C DIR`), in the same rounds")
    ap.add_argument("--baseline-revision", default="", help="the baseline tree's revision, for the results")
    ap.add_argument("--diagnose", help="with --presets: also time te_nvfp4 with these parts of the "
                    f"quantizer replaced by cheaper wrong-bits stand-ins ({', '.join(DIAGNOSTICS)})")
    ap.add_argument("--preset-case", help=argparse.SUPPRESS)  # PRESET,LAYOUT,RECIPE[,DIAGNOSTIC]: measure here
    ap.add_argument("--quantizer-case", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quantizer", action="store_true",
                    help="only the compile time of jit(quantize_nvfp4) on 32x64 and of the per-tensor factors")
    ap.add_argument("--layers", default="2,8,32")
    ap.add_argument("--recipes", default="bf16,te_nvfp4")
    ap.add_argument("--layouts", default="scanned,unrolled")
    ap.add_argument("--rounds", type=int, default=2, help="passes over all cases; each case keeps its fastest")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--case", help=argparse.SUPPRESS)  # LAYERS,SCAN,RECIPE: measure in this process
    args = ap.parse_args(argv)
    args.argv = list(argv or sys.argv[1:])
    unknown = [d for d in (args.diagnose or "").split(",") if d and d not in DIAGNOSTICS]
    if unknown:
        print(f"error: --diagnose {unknown[0]!r} is not a diagnostic; choose from {', '.join(DIAGNOSTICS)}",
              file=sys.stderr)
        sys.exit(2)
    if args.quantizer_case:
        print(json.dumps(measure_quantizer()), flush=True)
        return {}
    if args.preset_case:
        preset, layout, recipe, *diagnostic = args.preset_case.split(",")
        print(json.dumps(measure_preset(preset, layout == "scanned", recipe, *diagnostic)), flush=True)
        return {}
    if args.quantizer:
        import jax

        runs = [in_fresh_process(__file__, ["--quantizer-case"]) for _ in range(args.rounds)]
        best = {name: min((r[name] for r in runs), key=lambda v: v["total_s"]) for name in runs[0]}
        for name, row in best.items():
            print(f"jit({name}): lower {row['lower_s']:.3f} s + compile {row['compile_s']:.3f} s = "
                  f"{row['total_s']:.3f} s ({row['hlo_instructions']} HLO instructions)", flush=True)
        result = dict(command="python " + " ".join([os.path.relpath(__file__, Path.cwd())] + args.argv),
                      **environment(), goal_s=1.0, note="each run in a fresh process after one warm-up "
                      "compile; the fastest of --rounds runs, every run under runs", best=best, runs=runs)
        write_json(HERE / "results" / f"compile_quantizer_jax{jax.__version__}.json", result)
        return result
    if args.presets:
        return presets_main(args)
    if args.case:
        layers, scan, recipe = args.case.split(",")
        print(json.dumps(measure(int(layers), scan == "scanned", recipe)), flush=True)
        return {}

    t0 = time.perf_counter()
    cases = [(recipe, layout, int(layers)) for recipe in args.recipes.split(",")
             for layout in args.layouts.split(",") for layers in args.layers.split(",")]
    print(f"{'round':5s} {'recipe':10s} {'layout':9s} {'layers':>6s} {'lower s':>8s} {'compile s':>9s} "
          f"{'1st step s':>10s} {'total s':>8s}", flush=True)

    def show(round_, case, row):
        recipe, layout, layers = case
        row["total_s"] = round(row["lower_and_compile_s"] + row["first_step_s"], 2)
        print(f"{round_ + 1:5d} {recipe:10s} {layout:9s} {layers:6d} {row['lower_s']:8.2f} "
              f"{row['compile_s']:9.2f} {row['first_step_s']:10.3f} {row['total_s']:8.2f}", flush=True)

    rows = _fastest_of_rounds(cases, args.rounds, lambda c: in_fresh_process(__file__, ["--case", f"{c[2]},{c[1]},{c[0]}"]), "total_s", show)
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
