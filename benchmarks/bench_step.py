"""Train-step time of the `tiny` and `small-25m` presets under BF16, FP8 and NVFP4, in one run.

    python benchmarks/bench_step.py [--presets tiny,small-25m] [--warmup 2]
        [--tiny-batch 8 --tiny-seq 128 --tiny-repeats 30]
        [--small-batch 2 --small-seq 256 --small-repeats 15] [--no-diagnostics]
        [--profile te_nvfp4 --profile-steps 3] [--out PATH]

Each case is the real train step (`build_model`, `make_optimizer`, `init_state`,
`make_train_step`, jitted with the state's shardings and donated state, as `train/loop.py`
does; see `_harness.py`) on one device and one fixed synthetic batch, so data loading is not
timed. After `--warmup` untimed steps (the first compiles), every repeat runs one step of each
case in turn, so load from other processes hits every case alike; a case's time is the median
over repeats.

A diagnostic case (off with `--no-diagnostics`) says where the time goes:

- `te_nvfp4 (identity quantizer)`: te_nvfp4's custom-VJP GEMMs with the quantizer replaced by a
  cast to bf16 (same three GEMMs per projection, bf16 operands, fp32 accumulation; no
  quantization, RHT or stochastic rounding). bf16 -> identity is the GEMM structure,
  identity -> te_nvfp4_no_rht the quantization, te_nvfp4_no_rht -> te_nvfp4 the RHT.

`--profile` cases also get their op time split by category (quantized GEMMs, the quantizer's
random bits, the rest of the quantizer, the rest of forward and backward) from a `jax.profiler`
trace, each op attributed by the JAX source path in its HLO metadata.

Prints a table per preset and writes JSON (step seconds, tokens/s, TFLOP/s, ratio to bf16).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from _report import environment, write_json  # noqa: E402
from _harness import StepCase, hlo_op_names, interleaved, traced_ops  # noqa: E402
from nvfp4_jax import sharding  # noqa: E402
from nvfp4_jax.config import Config, MeshConfig, make_config  # noqa: E402
from nvfp4_jax.flops import parameter_count, training_flops_per_step  # noqa: E402
from nvfp4_jax.model import Llama, select_attention  # noqa: E402
from nvfp4_jax.quant import make_dot_general  # noqa: E402
from nvfp4_jax.quant.nvfp4_backend import NVFP4Backend, emulated_gemm  # noqa: E402
from nvfp4_jax.train.build import build_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "step.json"
RECIPES = ("bf16", "te_fp8_delayedscaling", "te_nvfp4_no_rht", "te_nvfp4")
IDENTITY = "te_nvfp4 (identity quantizer)"
GOAL_RATIO = 1.5  # the goal: emulated te_nvfp4 step within 1.5x of the bf16 step


def _identity_operand(x, spec, key=None):
    """An operand quantizer's signature, without the quantization: bf16 values, scale 1."""
    del spec, key
    return x.astype(jnp.bfloat16), jnp.float32(1.0)


IDENTITY_BACKEND = NVFP4Backend("identity", _identity_operand, emulated_gemm)


def _identity_model(cfg: Config) -> Llama:
    recipe = cfg.model.mlp_recipe

    def factory():
        # A fixed key: the identity operand never draws random bits.
        return make_dot_general(recipe, jax.random.PRNGKey(0), backend=IDENTITY_BACKEND)

    return Llama(cfg.model, mlp_dot_general_cls=factory,
                 attention_kernel=select_attention(cfg.model.attention, seq_len=cfg.model.max_target_length).kernel)


def _op_category(op_name: str, hlo_op: str) -> str:
    if "QuantDotGeneral" in op_name:
        if op_name.endswith("dot_general") or hlo_op.startswith("ynn_fusion"):
            return "quantized GEMMs"
        if any(k in op_name for k in ("threefry", "random", "/while")):
            return "quantizer: stochastic-rounding random bits"
        return "quantizer: amax, scales, rounding, RHT, layout"
    if "transpose(jvp(" in op_name:
        return "rest of backward"
    if "jvp(" in op_name:
        return "rest of forward"
    return "optimizer, loss, copies, other"


def op_breakdown(case: StepCase, steps: int) -> dict:
    """Shares of the step's op time by category, from a profiler trace of `steps` steps.

    Ops are attributed by the JAX source path in their HLO metadata: everything under a
    `QuantDotGeneral` is the quantized dot (its GEMMs, its random bits, the rest of its
    quantizer); the rest splits into forward, backward and the remainder.
    """
    names = hlo_op_names(case)
    by_category: dict[str, float] = collections.defaultdict(float)
    for hlo_op, _, us in traced_ops(case, steps):
        by_category[_op_category(names.get(hlo_op, ""), hlo_op)] += us
    total = sum(by_category.values())
    return dict(
        profiled_steps=steps,
        op_time_ms_per_step=round(total / steps / 1e3, 2),
        shares={k: round(v / total, 3) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
    )


def bench_preset(preset: str, batch: int, seq: int, cases: list[str], warmup: int, repeats: int,
                 profile: list[str], profile_steps: int):
    mesh = sharding.make_mesh(MeshConfig(ici_fsdp_parallelism=1), devices=jax.devices()[:1])
    built: dict[str, StepCase] = {}
    for name in cases:
        flag = {IDENTITY: "te_nvfp4"}.get(name, name)
        cfg = make_config({
            "model_name": preset, "quantization": flag, "per_device_batch_size": batch,
            "max_target_length": seq, "dataset_type": "synthetic", "steps": 10_000,
        })
        if name == IDENTITY:
            model = _identity_model(cfg)
        else:
            model = build_model(cfg.model)
        built[name] = StepCase(cfg, mesh, model)
    interleaved(list(built.values()), warmup, repeats)

    tokens = batch * seq
    flops = training_flops_per_step(cfg.model, batch, seq)
    bf16 = statistics.median(built["bf16"].times) if "bf16" in built else None
    bf16_min = min(built["bf16"].times) if "bf16" in built else None
    profiles = {}
    for name in profile:
        if name in built:
            try:
                profiles[name] = op_breakdown(built[name], profile_steps)
            except Exception as e:  # say so; never invent numbers
                profiles[name] = dict(error=f"{type(e).__name__}: {e}")
    rows = []
    for name, case in built.items():
        med = statistics.median(case.times)
        rows.append(dict(
            case=name,
            median_step_s=round(med, 5),
            min_step_s=round(min(case.times), 5),
            max_step_s=round(max(case.times), 5),
            tokens_per_s=round(tokens / med, 1),
            tflops_per_s=round(flops / med / 1e12, 5),
            ratio_to_bf16=round(med / bf16, 3) if bf16 else None,
            min_ratio_to_bf16=round(min(case.times) / bf16_min, 3) if bf16_min else None,
            first_step_s=round(case.first_step_s, 2),
            last_loss=round(case.loss, 4),
            times_s=[round(t, 4) for t in case.times],
        ))
    return dict(
        preset=preset,
        repeats=repeats,
        parameters=parameter_count(cfg.model),
        per_device_batch_size=batch,
        max_target_length=seq,
        tokens_per_step=tokens,
        model_flops_per_step=flops,
        rows=rows,
        breakdown=_breakdown({r["case"]: r["median_step_s"] for r in rows}),
        op_time_shares=profiles,
    )


def _breakdown(med: dict[str, float]) -> dict | None:
    """Where te_nvfp4's extra time over bf16 goes, as fractions of the te_nvfp4 step."""
    need = ("bf16", IDENTITY, "te_nvfp4_no_rht", "te_nvfp4")
    if not all(k in med for k in need):
        return None
    bf16, ident, no_rht, full = (med[k] for k in need)
    return dict(
        note="differences of interleaved medians, as fractions of the te_nvfp4 step; noise can "
        "make a small one negative",
        bf16_work=round(bf16 / full, 3),
        gemm_structure=round((ident - bf16) / full, 3),
        quantization_without_rht=round((no_rht - ident) / full, 3),
        rht=round((full - no_rht) / full, 3),
        quantization_total=round((full - ident) / full, 3),
    )


def _print(result: dict) -> None:
    print(f"\n{result['preset']}: {result['parameters']:,} parameters, batch "
          f"{result['per_device_batch_size']} x seq {result['max_target_length']} "
          f"= {result['tokens_per_step']} tokens/step")
    print(f"{'case':32s} {'median s':>9s} {'min s':>8s} {'tokens/s':>9s} {'/bf16':>6s} {'1st step s':>10s}")
    for r in result["rows"]:
        ratio = "" if r["ratio_to_bf16"] is None else f"{r['ratio_to_bf16']:6.2f}"
        print(f"{r['case']:32s} {r['median_step_s']:9.4f} {r['min_step_s']:8.4f} "
              f"{r['tokens_per_s']:9.0f} {ratio:>6s} {r['first_step_s']:10.1f}")
    for name, p in result["op_time_shares"].items():
        if "shares" in p:
            print(f"{name} op time by category (profiler, {p['op_time_ms_per_step']:.0f} ms/step of ops): "
                  + ", ".join(f"{k} {v:.0%}" for k, v in p["shares"].items()))
        else:
            print(f"{name} op time by category: {p['error']}")
    b = result["breakdown"]
    if b:
        print(f"te_nvfp4 step = bf16 work {b['bf16_work']:.0%} + GEMM structure "
              f"{b['gemm_structure']:.0%} + quantization {b['quantization_without_rht']:.0%} "
              f"+ RHT {b['rht']:.0%}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small-25m")
    ap.add_argument("--recipes", default=",".join(RECIPES),
                    help="comma-separated quantization flags (bf16 first for the ratios)")
    ap.add_argument("--no-diagnostics", action="store_true",
                    help="skip the identity-quantizer case")
    ap.add_argument("--tiny-batch", type=int, default=8)
    ap.add_argument("--tiny-seq", type=int, default=128)
    ap.add_argument("--tiny-repeats", type=int, default=30)
    ap.add_argument("--small-batch", type=int, default=2)
    ap.add_argument("--small-seq", type=int, default=256)
    ap.add_argument("--small-repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per case (the first compiles)")
    ap.add_argument("--profile", default="te_nvfp4",
                    help="comma-separated cases whose op time to break down from a profiler trace")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    cases = [r for r in args.recipes.split(",") if r]
    if not args.no_diagnostics:
        cases += [IDENTITY] if "te_nvfp4" in cases else []
    shapes = {
        "tiny": (args.tiny_batch, args.tiny_seq, args.tiny_repeats),
        "small-25m": (args.small_batch, args.small_seq, args.small_repeats),
    }
    t0 = time.perf_counter()
    results = []
    for preset in [p for p in args.presets.split(",") if p]:
        batch, seq, repeats = shapes.get(preset, shapes["tiny"])
        results.append(bench_preset(preset, batch, seq, cases, args.warmup, repeats,
                                    [c for c in args.profile.split(",") if c], args.profile_steps))
        _print(results[-1])

    goal = {}
    for res in results:
        ratio = {r["case"]: r["ratio_to_bf16"] for r in res["rows"]}.get("te_nvfp4")
        if ratio is not None:
            goal[res["preset"]] = dict(te_nvfp4_over_bf16=ratio, met=ratio <= GOAL_RATIO)
    if goal:
        print("\ngoal: te_nvfp4 step <= %.1fx bf16: %s" % (GOAL_RATIO, ", ".join(
            f"{p} {g['te_nvfp4_over_bf16']:.2f}x ({'met' if g['met'] else 'not met'})"
            for p, g in goal.items())))

    result = dict(
        command="python " + " ".join([os.path.relpath(__file__, Path.cwd())] + list(argv or sys.argv[1:])),
        warmup=args.warmup,
        **environment(),
        wall_s=round(time.perf_counter() - t0, 1),
        note="median of interleaved repeats after warm-up; one device; fixed synthetic batch; "
        "first_step_s includes compilation. CPU emulation: the NVFP4/FP8 GEMMs run as bf16 "
        "GEMMs after quantizing, so their cost here is the quantizer's, not FP4 hardware's.",
        goal=dict(te_nvfp4_over_bf16_max=GOAL_RATIO, presets=goal),
        presets=results,
    )
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    if "maxtext" in old:  # written by hand from a separate MaxText run; keep it
        result["maxtext"] = old["maxtext"]
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
