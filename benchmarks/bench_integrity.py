"""What the run-integrity checks cost: the per-step finiteness flags, and checksummed saves.

    python benchmarks/bench_integrity.py [--presets tiny,small-25m] [--repeats 20] [--out PATH]

For each preset (BF16, one device, the bench_step shapes), two train steps are timed interleaved
(`_harness.interleaved`): the package's step, whose metrics carry a finiteness flag per state leaf
(`integrity.finite_flags`), and the same step with that metric dropped, which XLA then removes.
Their ratio is the flags' cost. Then, once each after a warm-up: `integrity.inspect` of the state
(the checksums and flags a save records), a whole `checkpoint.save`, and a `checkpoint.restore`
with its verification.

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import _harness  # noqa: E402
import _report  # noqa: E402
from nvfp4_jax import sharding  # noqa: E402
from nvfp4_jax.config import load_config  # noqa: E402
from nvfp4_jax.train import checkpoint, integrity  # noqa: E402
from nvfp4_jax.train.build import build_model, state_shardings  # noqa: E402
from nvfp4_jax.train.optimizer import make_optimizer  # noqa: E402
from nvfp4_jax.train.step import make_train_step  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "integrity.json"
SHAPES = {"tiny": (8, 128), "small-25m": (2, 256)}


def _without_flags(case: _harness.StepCase, cfg, mesh, model) -> None:
    """Replaces `case.step` by the same step minus its finiteness metric."""
    optimizer = make_optimizer(cfg.train)
    step = make_train_step(model, optimizer)
    _, state_sh = state_shardings(model, optimizer, cfg.model.max_target_length, mesh)

    def no_flags(state, batch):
        state, metrics = step(state, batch)
        return state, {k: v for k, v in metrics.items() if k != "finite"}

    case.step = sharding.sharded_jit(no_flags, mesh, in_shardings=(state_sh, sharding.batch_sharding(mesh)),
                                     out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=0)


def _seconds(fn, repeats: int = 3) -> float:
    fn()  # warm-up: compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_preset(preset: str, repeats: int) -> dict:
    batch, seq = SHAPES[preset]
    cfg = load_config([f"model_name={preset}", "quantization=bf16", f"per_device_batch_size={batch}",
                       f"max_target_length={seq}", "ici_fsdp_parallelism=1", "dataset_type=synthetic"])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    model = build_model(cfg.model)
    flagged = _harness.StepCase(cfg, mesh, model)
    plain = _harness.StepCase(cfg, mesh, model)
    _without_flags(plain, cfg, mesh, model)
    _harness.interleaved([flagged, plain], warmup=2, repeats=repeats)
    with_flags, without = statistics.median(flagged.times), statistics.median(plain.times)

    state = flagged.state
    abstract, _ = state_shardings(model, make_optimizer(cfg.train), seq, mesh)
    with tempfile.TemporaryDirectory() as tmp:
        manager = checkpoint.make_manager(tmp, max_to_keep=1)
        counter = iter(range(1, 10**6))

        def save():
            # A new step number each time (orbax saves a step once); same state bits.
            checkpoint.save(manager, state.replace(step=state.step * 0 + next(counter)), {})

        save_s = _seconds(save)
        restore_s = _seconds(lambda: checkpoint.restore(manager, abstract))
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    return dict(
        preset=preset, per_device_batch_size=batch, max_target_length=seq, repeats=repeats,
        state_mib=round(state_bytes / 2**20, 2), leaves=len(jax.tree.leaves(state)),
        step_s_with_flags=round(with_flags, 5), step_s_without_flags=round(without, 5),
        flags_overhead=round(with_flags / without - 1, 4),
        inspect_s=round(_seconds(lambda: integrity.inspect(state)), 5),
        save_s=round(save_s, 4), restore_and_verify_s=round(restore_s, 4),
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small-25m")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = [bench_preset(p, args.repeats) for p in args.presets.split(",") if p]
    print(f"{'preset':<10} {'state MiB':>9} {'step s':>8} {'no flags':>9} {'overhead':>9} "
          f"{'inspect s':>10} {'save s':>8} {'restore s':>10}")
    for r in rows:
        print(f"{r['preset']:<10} {r['state_mib']:>9.1f} {r['step_s_with_flags']:>8.4f} "
              f"{r['step_s_without_flags']:>9.4f} {100 * r['flags_overhead']:>8.1f}% {r['inspect_s']:>10.4f} "
              f"{r['save_s']:>8.3f} {r['restore_and_verify_s']:>10.3f}")
    result = dict(command="python benchmarks/bench_integrity.py " + " ".join(argv or sys.argv[1:]),
                  **_report.environment(), wall_s=round(time.perf_counter() - t0, 1),
                  note="BF16 step on one device; the flags' cost is relative to the smallest step, "
                       "the worst case. Save and restore include orbax's own work.",
                  presets=rows)
    _report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
