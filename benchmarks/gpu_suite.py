"""The one-call GPU benchmark (run it through `benchmarks/gpu_suite.sh`).

On an NVIDIA GPU, within about 8 minutes, with nothing installed beyond the image's jax, flax,
optax and orbax:

(a) `step`: the train step of a 1.1B-parameter Llama (d_model 2048, 16 layers of 16/8 heads of
    128, MLP 8192, vocabulary 32768, 8 x 4096 tokens per step; scanned layers, attention
    autoselected) under bf16, te_fp8_delayedscaling, te_nvfp4_no_rht and te_nvfp4: median step
    time, tokens/s, model TFLOP/s and MFU against the device's dense bf16 peak, lower + compile
    time, first step, and peak device memory (`memory_stats()["peak_bytes_in_use"]`).
(b) `breakdown`: where te_nvfp4's extra time goes, from the identity-quantizer diagnostic of
    `bench_step.py` (the same custom-VJP GEMMs with the quantizer replaced by a bf16 cast).
(c) `fp8_gemm`: whether the FP8 recipe's GEMMs run on FP8 tensor cores (cuBLASLt FP8 custom calls,
    `__cublas$lt$matmul$f8`, in the compiled HLO of the FP8 train step and of one projection),
    and that projection's fwd + bwd speed against bf16 at (M, K, N) = (8192, 4096, 14336) with a
    random dY passed in as an argument (a constant or a `sum()` loss lets XLA fold the backward).
(e) `long_context`: one long sequence (FULL: the (a) model at 32,768 tokens, batch 1, full remat,
    num_vocab_tiling 8, attention autoselected) on one device: step time and peak memory beside
    `nvfp4_jax.plan`'s estimate for the same config (context parallelism itself needs
    more than the one lent GPU).
(d) `quantize_kernels`: a marked hook for the Pallas quantize kernels of a later issue.

Every case runs in its own process (its own compile cache and memory high-water mark). Without
a GPU it runs a reduced version (small shapes, no peak) so the script itself can be tried; those
results go to a temporary folder, never into `benchmarks/results/gpu/`. JSON goes to `$OUT`
(when set) and, on a GPU, to `benchmarks/results/gpu/`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from _harness import in_fresh_process  # noqa: E402
from _report import environment, write_json  # noqa: E402

RESULTS = HERE / "results" / "gpu"
RECIPES = ("bf16", "te_fp8_delayedscaling", "te_nvfp4_no_rht", "te_nvfp4")
IDENTITY = "te_nvfp4 (identity quantizer)"
# Run order: the most wanted numbers first, in case the time budget runs out.
ORDER = ("bf16", "te_nvfp4", "te_fp8_delayedscaling", "fp8_gemm", IDENTITY, "te_nvfp4_no_rht", "long_context")
# Memory settings tried in turn until nvfp4_jax.plan says the step fits: fastest first.
MEMORY_SETTINGS = ((("remat_policy", "none"), ("num_vocab_tiling", 1)),
                   (("remat_policy", "none"), ("num_vocab_tiling", 4)),
                   (("remat_policy", "save_dot_except_mlp"), ("num_vocab_tiling", 4)),
                   (("remat_policy", "full"), ("num_vocab_tiling", 4)))
BUDGET_S = 8 * 60
# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by device kind, with where they come from.
BF16_PEAKS = {
    "H100": (989e12, "NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity)"),
    "H200": (989e12, "NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity)"),
    "B200": (2250e12, "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense BF16 per GPU (4.5 with sparsity)"),
    "A100": (312e12, "NVIDIA A100 SXM datasheet: 312 TFLOP/s dense BF16 (624 with sparsity)"),
}
FULL = dict(model=dict(vocab_size=32768, base_emb_dim=2048, base_num_query_heads=16, base_num_kv_heads=8,
                       head_dim=128, base_mlp_dim=8192, base_num_decoder_layers=16, max_target_length=4096),
            batch=8, repeats=6, gemm=(8192, 4096, 14336), gemm_repeats=20, long_context=32768)
REDUCED = dict(model=dict(vocab_size=256, base_emb_dim=128, base_num_query_heads=4, base_num_kv_heads=2,
                          head_dim=32, base_mlp_dim=384, base_num_decoder_layers=2, max_target_length=128),
               batch=2, repeats=3, gemm=(256, 128, 384), gemm_repeats=5, long_context=512)
FP8_CUSTOM_CALL = "__cublas$lt$matmul$f8"


def _on_gpu() -> bool:
    import jax

    return jax.devices()[0].platform == "gpu"


def _peak(device) -> tuple[float | None, str]:
    for kind, (flops, source) in BF16_PEAKS.items():
        if kind in device.device_kind:
            return flops, source
    return None, f"no bf16 peak on record for {device.device_kind!r}"


def _config(shapes: dict, recipe: str):
    """The case's config, with the fastest remat and loss tiling that the plan says fit."""
    from nvfp4_jax.config import make_config
    from nvfp4_jax.plan import local_device_memory, make_plan

    base = {"model_name": "tiny", **shapes["model"], "quantization": recipe,
            "per_device_batch_size": shapes["batch"], "dataset_type": "synthetic",
            "steps": 10_000, "scan_layers": True, "attention": "autoselected",
            "ici_fsdp_parallelism": 1}
    memory = local_device_memory()
    for setting in MEMORY_SETTINGS:
        cfg = make_config({**base, **dict(setting)})
        if memory is None or make_plan(cfg, 1, memory).fits:
            return cfg
    return cfg


def _peak_memory() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _fp8_calls(hlo: str) -> dict:
    """Counts of cuBLASLt FP8 GEMM calls and of all GEMM custom calls in compiled HLO text."""
    gemms = hlo.count('custom_call_target="__cublas$gemm"') + hlo.count('custom_call_target="__cublas$lt$matmul')
    return dict(fp8_gemm_calls=hlo.count(FP8_CUSTOM_CALL), gemm_custom_calls=gemms)


def part_step(case: str, shapes: dict) -> dict:
    """(a) One recipe's train step (or (b)'s identity diagnostic), in this process."""
    import jax
    from _harness import StepCase
    from bench_step import _identity_model
    from nvfp4_jax import sharding
    from nvfp4_jax.config import MeshConfig
    from nvfp4_jax.flops import parameter_count, training_flops_per_step
    from nvfp4_jax.train.build import build_model, describe_attention

    recipe = "te_nvfp4" if case == IDENTITY else case
    cfg = _config(shapes, recipe)
    mesh = sharding.make_mesh(MeshConfig(ici_fsdp_parallelism=1), devices=jax.devices()[:1])
    model = _identity_model(cfg) if case == IDENTITY else build_model(cfg.model)
    step = StepCase(cfg, mesh, model)
    step.compile()
    hlo = step.step.as_text() if recipe == "te_fp8_delayedscaling" else ""
    step.run(record=False)
    for _ in range(shapes["repeats"]):
        step.run()
    seconds = statistics.median(step.times)
    tokens = shapes["batch"] * cfg.model.max_target_length
    flops = training_flops_per_step(cfg.model, shapes["batch"], cfg.model.max_target_length)
    peak, source = _peak(jax.devices()[0])
    out = dict(case=case, parameters=parameter_count(cfg.model), tokens_per_step=tokens,
               median_step_s=round(seconds, 4), times_s=[round(t, 4) for t in step.times],
               tokens_per_s=round(tokens / seconds, 1), model_tflops_per_s=round(flops / seconds / 1e12, 2),
               mfu=round(flops / seconds / peak, 4) if peak else None, bf16_peak_flops=peak,
               bf16_peak_source=source, lower_s=round(step.lower_s, 2), compile_s=round(step.compile_s, 2),
               first_step_s=round(step.first_step_s, 3), peak_bytes_in_use=_peak_memory(),
               loss=round(step.loss, 4), attention=describe_attention(cfg.model),
               remat_policy=cfg.model.remat_policy, num_vocab_tiling=cfg.model.num_vocab_tiling)
    if hlo:
        out["hlo"] = _fp8_calls(hlo)
    return out


def part_fp8_gemm(shapes: dict, repeats: int) -> dict:
    """(c) One projection's forward and backward, bf16 against the FP8 recipe's quantized dot."""
    import jax
    import jax.numpy as jnp
    from nvfp4_jax.quant import get_recipe, init_fp8_meta, make_dot_general

    M, K, N = shapes["gemm"]
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (K, N), jnp.float32)
    dy = jax.random.normal(kg, (M, N), jnp.float32).astype(jnp.bfloat16)  # an argument: never folded
    dims = (((1,), (0,)), ((), ()))
    dots = {
        "bf16": lambda x, w, meta: jax.lax.dot_general(x, w.astype(jnp.bfloat16), dims,
                                                       preferred_element_type=jnp.float32),
        "te_fp8_delayedscaling": lambda x, w, meta: make_dot_general(get_recipe("te_fp8_delayedscaling"), fp8_meta=meta)(
            x, w, dims, preferred_element_type=jnp.float32),
    }
    out = dict(shape_mkn=[M, K, N], flops_fwd_bwd=6 * M * K * N)
    for name, dot in dots.items():
        def fwd_bwd(x, w, meta, dy, dot=dot):
            y, vjp = jax.vjp(lambda x, w: dot(x, w, meta).astype(jnp.bfloat16), x, w)
            return vjp(dy)

        fn = jax.jit(fwd_bwd)
        meta = init_fp8_meta(1024)
        compiled = fn.lower(x, w, meta, dy).compile()
        jax.block_until_ready(compiled(x, w, meta, dy))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(x, w, meta, dy))
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        out[name] = dict(median_s=round(seconds, 6), tflops_per_s=round(6 * M * K * N / seconds / 1e12, 2),
                         **_fp8_calls(compiled.as_text()))
    out["fp8_over_bf16_time"] = round(out["te_fp8_delayedscaling"]["median_s"] / out["bf16"]["median_s"], 3)
    return out


def part_quantize_kernels() -> dict:
    """(d) HOOK: the NVFP4 quantize-kernel benchmark goes here once the Pallas kernels exist.

    Expected: time `kernels/`' quantize (and its fused RHT + SR variants) against
    `nvfp4_jax.quant.quantize_nvfp4` on a (8192, 4096) bf16 tensor, in GB/s of input read, and
    check the two bitwise. Until then this part reports that it has nothing to run.
    """
    return dict(status="not run: no Pallas quantize kernels yet (a later issue adds them)")


def part_long_context(shapes: dict) -> dict:
    """(e) One sequence of `shapes["long_context"]` tokens on one device, against the plan."""
    import jax
    from _harness import StepCase
    from nvfp4_jax import sharding
    from nvfp4_jax.config import make_config
    from nvfp4_jax.plan import local_device_memory, make_plan
    from nvfp4_jax.train.build import build_model, describe_attention

    length = shapes["long_context"]
    cfg = make_config({"model_name": "tiny", **shapes["model"], "max_target_length": length,
                       "quantization": "bf16", "per_device_batch_size": 1, "dataset_type": "synthetic",
                       "steps": 10_000, "scan_layers": True, "attention": "autoselected",
                       "remat_policy": "full", "num_vocab_tiling": 8, "ici_fsdp_parallelism": 1})
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:1])
    planned = make_plan(cfg, 1, local_device_memory())
    step = StepCase(cfg, mesh, build_model(cfg.model))
    step.compile()
    step.run(record=False)
    for _ in range(max(shapes["repeats"] // 2, 1)):
        step.run()
    return dict(case="long_context", tokens=length, median_step_s=round(statistics.median(step.times), 4),
                tokens_per_s=round(length / statistics.median(step.times), 1),
                peak_bytes_in_use=_peak_memory(), plan_total_bytes=planned.total_bytes_per_device,
                plan_fits=planned.fits, attention=describe_attention(cfg.model),
                compile_s=round(step.compile_s, 2))


def _child(args) -> dict:
    shapes = REDUCED if args.reduced else FULL
    if args.part == "long_context":
        return part_long_context(shapes)
    if args.part == "step":
        return part_step(args.case, shapes)
    if args.part == "fp8_gemm":
        return part_fp8_gemm(shapes, shapes["gemm_repeats"])
    raise ValueError(f"unknown part {args.part!r}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reduced", action="store_true", help="small shapes (the default without a GPU)")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where the JSON goes (default: benchmarks/results/gpu on a GPU, a temp dir otherwise)")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part:
        print(json.dumps(_child(args)), flush=True)
        return {}

    t0 = time.perf_counter()
    gpu = _on_gpu()
    reduced = args.reduced or not gpu
    flags = ["--reduced"] if reduced else []
    out_dirs = [Path(os.environ["OUT"])] if os.environ.get("OUT") else []
    out_dirs.append(args.out_dir or (RESULTS if gpu else Path(tempfile.gettempdir()) / "nvfp4_gpu_suite"))
    print(f"gpu_suite: {'reduced shapes (no GPU)' if not gpu else 'reduced shapes' if reduced else 'full shapes'}; "
          f"writing to {', '.join(map(str, out_dirs))}", flush=True)

    def left() -> float:
        return BUDGET_S - (time.perf_counter() - t0)

    def run(name: str, part_args: list[str]) -> dict:
        if left() < 30:
            print(f"  {name}: skipped, the {BUDGET_S // 60}-minute budget is spent", flush=True)
            return dict(skipped=f"time budget of {BUDGET_S} s spent")
        try:
            return in_fresh_process(__file__, part_args + flags, timeout=left())
        except RuntimeError as err:
            print(f"  {name}: FAILED\n{err}", flush=True)
            return dict(error=str(err))

    steps, gemm, long_context = {}, {}, {}
    for case in ORDER:
        if case == "fp8_gemm":
            gemm = run(case, ["--part", "fp8_gemm"])
            if "fp8_over_bf16_time" in gemm:
                print(f"  fp8 GEMM {gemm['shape_mkn']}: bf16 {gemm['bf16']['tflops_per_s']} TFLOP/s, "
                      f"FP8 recipe {gemm['te_fp8_delayedscaling']['tflops_per_s']} TFLOP/s "
                      f"({gemm['fp8_over_bf16_time']}x the bf16 time); cuBLASLt FP8 calls: "
                      f"{gemm['te_fp8_delayedscaling']['fp8_gemm_calls']}", flush=True)
            continue
        if case == "long_context":
            long_context = run(case, ["--part", "long_context"])
            if "median_step_s" in long_context:
                print(f"  long context {long_context['tokens']} tokens: {long_context['median_step_s']:.3f} s/step, "
                      f"peak {long_context['peak_bytes_in_use']}, plan {long_context['plan_total_bytes']:.3g} B", flush=True)
            continue
        steps[case] = r = run(case, ["--part", "step", "--case", case])
        if "median_step_s" in r:
            mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
            mem = "n/a" if r["peak_bytes_in_use"] is None else f"{r['peak_bytes_in_use'] / 2**30:.1f} GiB"
            print(f"  {case:30s} {r['median_step_s']:.4f} s/step {r['tokens_per_s']:10.0f} tok/s "
                  f"{r['model_tflops_per_s']:8.2f} TFLOP/s MFU {mfu:>6s} compile {r['lower_s'] + r['compile_s']:.1f} s "
                  f"1st step {r['first_step_s']:.2f} s peak mem {mem}", flush=True)

    from bench_step import _breakdown

    medians = {k: v["median_step_s"] for k, v in steps.items() if "median_step_s" in v}
    bf16 = medians.get("bf16")
    breakdown = _breakdown(medians)
    if breakdown:
        breakdown["note"] = ("differences of medians from separate processes, as fractions of the "
                             "te_nvfp4 step; noise can make a small one negative")
    result = dict(
        **environment(),
        mode="reduced" if reduced else "full",
        wall_s=round(time.perf_counter() - t0, 1),
        budget_s=BUDGET_S,
        shapes=REDUCED if reduced else FULL,
        note="median of timed steps after one untimed first step; each case in its own process; "
        "MFU = model FLOPs (nvfp4_jax.flops, MaxText's count) / step time / bf16 dense peak. "
        "The FP8 and NVFP4 recipes are emulated (quantize, then bf16 GEMMs) unless the compiled "
        "HLO shows FP8 custom calls.",
        step={k: {**v, "ratio_to_bf16": round(v["median_step_s"] / bf16, 3) if bf16 and "median_step_s" in v else None}
              for k, v in steps.items()},
        breakdown=breakdown,
        fp8_tensor_cores=dict(
            train_step_hlo=steps.get("te_fp8_delayedscaling", {}).get("hlo"),
            gemm=gemm,
        ),
        quantize_kernels=part_quantize_kernels(),
        long_context=long_context,
    )
    for folder in out_dirs:
        write_json(folder / "gpu_suite.json", result)
    print(f"gpu_suite: done in {result['wall_s']:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
