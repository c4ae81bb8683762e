"""Compiled memory of a train step against sequence length: attention=dot_product vs chunked.

    python benchmarks/bench_attention_memory.py [--lengths 1024,2048,4096,8192,16384] [--out PATH]

For each length and kernel, the package's own train step (`assembly.assemble(cfg).train_step`, with
the state's shardings and donated state) of the tiny model (4 layers, d_model 128, 4 query and
2 KV heads of 32, batch 1, bf16 compute, no remat) is lowered on abstract inputs and compiled;
nothing is allocated or run. XLA's `memory_analysis()` of the executable gives the bytes of its
temporaries (activations saved for the backward pass, scores, workspace) beside its arguments.
dot_product's temporaries grow with L^2 (its fp32 scores, `[B, G, R, L, L]` per layer), the
chunked kernel's with L. Prints a table and writes `benchmarks/results/attention_memory.json`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402

from _report import environment, write_json  # noqa: E402
from nvfp4_jax.config import MeshConfig, make_config, to_dict  # noqa: E402
from nvfp4_jax.train import assembly  # noqa: E402

OUT = HERE / "results" / "attention_memory.json"
BASE = dict(model_name="tiny", per_device_batch_size=1, remat_policy="none", dataset_type="synthetic")
MiB = 2**20


def measure(seq_len: int, kernel: str, chunk: int) -> dict:
    cfg = make_config({**BASE, "max_target_length": seq_len, "attention": kernel,
                       "attention_chunk_size": chunk})
    run = assembly.assemble(cfg, jax.devices()[:1], mesh_config=MeshConfig(ici_fsdp_parallelism=1))
    tokens = jax.ShapeDtypeStruct((run.global_batch, seq_len), "int32", sharding=run.batch_sharding)
    t0 = time.perf_counter()
    compiled = run.train_step.lower(run.abstract_state, {"inputs": tokens, "targets": tokens}).compile()
    mem = compiled.memory_analysis()
    return dict(seq_len=seq_len, kernel=kernel, compile_s=round(time.perf_counter() - t0, 1),
                temp_mib=round(mem.temp_size_in_bytes / MiB, 2),
                argument_mib=round(mem.argument_size_in_bytes / MiB, 2),
                output_mib=round(mem.output_size_in_bytes / MiB, 2))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--chunk", type=int, default=512, help="attention_chunk_size of the chunked kernel")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    env = environment()  # the revision as the cases start, before anything can change it
    rows = []
    print(f"{'tokens':>7} {'kernel':>12} {'temp MiB':>10} {'args MiB':>9} {'compile s':>9}")
    for seq_len in (int(x) for x in args.lengths.split(",")):
        for kernel in ("dot_product", "chunked"):
            row = measure(seq_len, kernel, args.chunk)
            rows.append(row)
            print(f"{seq_len:>7} {kernel:>12} {row['temp_mib']:>10.1f} {row['argument_mib']:>9.1f} "
                  f"{row['compile_s']:>9.1f}", flush=True)
    cfg = make_config({**BASE, "attention": "chunked", "attention_chunk_size": args.chunk})
    result = dict(benchmark="attention_memory", environment=env, config=to_dict(cfg),
                  note="compiled only (memory_analysis of the executable), never run; "
                       "max_target_length and attention vary per row",
                  rows=rows)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
