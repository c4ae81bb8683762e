"""Context parallelism on virtual CPU devices: step time, peak memory and exchanged bytes vs length.

    python benchmarks/bench_context.py [--lengths 1024,2048,4096] [--contexts 1,2,4,8]
        [--strategies all_gather,ulysses] [--attention dot_product] [--repeats 2] [--out PATH]

One sequence of each length is split over `c` devices (`ici_context_parallelism=c`,
`per_device_batch_size=1/c`, the first c of 8 host-platform devices) and trained by the real
train step (`_harness.StepCase`) of a one-layer `tiny` model with 8 query heads (so Ulysses can
split them 8 ways) and 2 KV heads (repeated for c > 2), BF16. For each case it records

- the median step time over `--repeats` steps after one untimed step (the devices share this
  machine's cores: more devices cannot make a step faster; this shows the overhead and how the
  per-device work shrinks),
- the compiled step's peak memory per device (`memory_analysis()`: temporaries + arguments +
  outputs - aliased), which is what context parallelism is for,
- the elements each device sends by all-to-all, all-gather and reduce-scatter, read from the compiled HLO (an
  all-to-all of a buffer of S elements sends (c-1)/c of it, an all-gather receiving S elements
  brought in (c-1)/c of it), times 2 bytes (bf16; XLA:CPU itself moves them as f32), beside
  `plan.communication_bytes`' formula. The attention exchanges are the [..., heads, K] pieces;
  the embedding lookup's all-to-all is reported apart.

Writes benchmarks/results/context.json and context.png.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from _harness import StepCase  # noqa: E402
from _report import environment, write_json  # noqa: E402
from nvfp4_jax import plan, sharding  # noqa: E402
from nvfp4_jax.config import make_config  # noqa: E402
from nvfp4_jax.train.build import build_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "context.json"


def exchanged_elements(hlo: str, op: str, ways: int, shard_length: int, head_dim: int) -> dict[str, float]:
    """Elements one device sends by `op` per step: attention's ([B, L/c or L, heads, head_dim]
    pieces) and the rest (the embedding lookup's), with the element types seen.

    Counted in elements, not bytes: XLA:CPU runs bf16 collectives in f32 (the HLO shows f32),
    a GPU in bf16; the formula is in the compute dtype.
    """
    out = {"attention": 0.0, "other": 0.0, "dtypes": set()}
    for result in re.findall(rf"= (\(.*?\)|\w+\[[0-9,]*\]\S*) {op}\(", hlo):
        for dtype, dims in re.findall(r"(\w+)\[([0-9,]*)\]", result):
            shape = [int(d) for d in dims.split(",") if d]
            attention = len(shape) == 4 and shape[-1] == head_dim and shape[1] in (shard_length, shard_length * ways)
            kind = "attention" if attention else "other"
            out[kind] += float(np.prod(shape)) * (ways - 1) / ways
            out["dtypes"].add(dtype)
    out["dtypes"] = sorted(out["dtypes"])
    return out


def _case(length: int, c: int, strategy: str, args):
    cfg = make_config({
        "model_name": "tiny", "base_num_decoder_layers": 1, "base_num_query_heads": 8,
        "base_num_kv_heads": 2, "head_dim": 16, "max_target_length": length, "quantization": "bf16",
        "attention": args.attention, "per_device_batch_size": 1 / c, "ici_fsdp_parallelism": 1,
        "ici_context_parallelism": c, "context_parallel_strategy": strategy, "dataset_type": "synthetic",
        "steps": 10_000, "warmup_steps_fraction": 0.0,
    })
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:c])
    sharding.check_divisibility(cfg, mesh)
    return cfg, StepCase(cfg, mesh, build_model(cfg.model))


def measure(length: int, c: int, strategy: str, args) -> dict:
    cfg, case = _case(length, c, strategy, args)
    t0 = time.perf_counter()
    lowered = case.step.lower(case.state, case.batch)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    peak = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes)
    case.step = compiled
    case.run(record=False)
    for _ in range(args.repeats):
        case.run()
    K = cfg.model.head_dim
    Lc = length // c
    a2a, ag = exchanged_elements(hlo, "all-to-all", c, Lc, K), exchanged_elements(hlo, "all-gather", c, Lc, K)
    rs = exchanged_elements(hlo, "reduce-scatter", c, Lc, K)  # all_gather's backward: dK, dV
    formula = plan.communication_bytes(cfg.model, 1, c, 1)
    a = 2  # bf16 compute: the bytes a GPU would send
    return dict(
        length=length, context=c, strategy=strategy, attention=args.attention,
        median_step_s=round(statistics.median(case.times), 4), compile_s=round(compile_s, 1),
        peak_memory_bytes_per_device=int(peak),
        # HLO element counts x 2 bytes (bf16), comparable to the formula.
        hlo_all_to_all_attention_bytes=a * a2a["attention"], hlo_all_to_all_other_bytes=a * a2a["other"],
        hlo_all_gather_attention_bytes=a * ag["attention"], hlo_all_gather_other_bytes=a * ag["other"],
        hlo_reduce_scatter_attention_bytes=a * rs["attention"],
        hlo_collective_dtypes=sorted(set(a2a["dtypes"]) | set(ag["dtypes"]) | set(rs["dtypes"])),
        formula_ulysses_bytes=formula.ulysses, formula_all_gather_bytes=formula.all_gather,
        formula_ring_bytes=formula.ring, loss=round(case.loss, 4),
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["context"], r["strategy"]) for r in rows}):
        sel = sorted((r for r in rows if (r["context"], r["strategy"]) == key), key=lambda r: r["length"])
        label = f"context={key[0]}" + (f" {key[1]}" if key[0] > 1 else "")
        xs = [r["length"] for r in sel]
        ax_t.plot(xs, [r["median_step_s"] for r in sel], marker="o", label=label)
        ax_m.plot(xs, [r["peak_memory_bytes_per_device"] / 2**20 for r in sel], marker="o", label=label)
    for ax, ylabel in ((ax_t, "median step time (s)"), (ax_m, "peak memory per device (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens, one sequence)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_m.legend(fontsize=7)
    fig.suptitle("tiny (1 layer, 8 heads), BF16, virtual CPU devices sharing the same cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--contexts", default="1,2,4,8")
    ap.add_argument("--strategies", default="all_gather,ulysses")
    ap.add_argument("--attention", default="dot_product")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rows = []
    t0 = time.perf_counter()
    for length in [int(x) for x in args.lengths.split(",")]:
        for c in [int(x) for x in args.contexts.split(",")]:
            for strategy in (["all_gather"] if c == 1 else args.strategies.split(",")):
                row = measure(length, c, strategy, args)
                rows.append(row)
                print(f"L={length:6d} context={c} {strategy:10s} step {row['median_step_s']:.3f} s  "
                      f"peak {row['peak_memory_bytes_per_device'] / 2**20:8.1f} MiB/device  "
                      f"all-to-all {row['hlo_all_to_all_attention_bytes'] / 2**20:7.2f} MiB "
                      f"(formula ulysses {row['formula_ulysses_bytes'] / 2**20:7.2f})  "
                      f"all-gather + reduce-scatter {(row['hlo_all_gather_attention_bytes'] + row['hlo_reduce_scatter_attention_bytes']) / 2**20:7.2f} MiB "
                      f"(formula {row['formula_all_gather_bytes'] / 2**20:7.2f})", flush=True)
    result = dict(benchmark="bench_context", environment=environment(), args=vars(args) | {"out": str(args.out)},
                  wall_s=round(time.perf_counter() - t0, 1), rows=rows)
    write_json(args.out, result)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
