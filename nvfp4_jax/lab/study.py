"""A study: every arm trained over every seed from one base config, then compared.

Runs go seed by seed (all arms of seed 0, then of seed 1, ...), so a study cut short still
compares every arm; the extended runs (`--extend`) come last. SIGTERM/SIGINT stops a study like
a run: the current run saves, no further run starts, what there is is written (runs.StudyStopped). Each run lives in `<runs_dir>/<arm>-seed<seed>/`; finished runs are read
back, interrupted ones resumed (see `runs`). `results.json` and `summary.md` are rewritten after
every run, the plots at the end.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Callable, Sequence

from nvfp4_jax.config import Config, config_layers, make_config, to_dict
from nvfp4_jax.lab import analysis, plots, provenance, report, runs
from nvfp4_jax.lab.arms import Arm, arm_config

SEED_NOTE = (
    "A seed sets the initial weights, the stochastic-rounding keys, and which windows of the "
    "corpus make up the training batches and the held-out batches. All arms of one seed start "
    "from the same weights and see the same batches in the same order; seeds differ in all of it."
)


def _run_directory(cfg: Config) -> str:
    return os.path.join(cfg.train.base_output_directory, cfg.train.run_name)


def _arm_note(arm: Arm, cfg: Config, base: Config) -> str:
    """The keys in which the arm's config differs from the base config."""
    changed = [f"quantization={cfg.model.quantization or 'bf16'}"]
    for section in ("model", "data", "train", "mesh"):
        ours, theirs = getattr(cfg, section), getattr(base, section)
        for key, value in vars(ours).items():
            if key not in ("seed", "run_name", "base_output_directory", "quantization") \
                    and getattr(theirs, key) != value:
                changed.append(f"{key}={value}")
    return ", ".join(changed)


def _environment() -> dict[str, Any]:
    # the lab reads runs without jax; only a study that trains loads it
    import jax

    return {"jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()}


def plan_study(base_args: Sequence[str], arms: Sequence[Arm], *, seeds: int, runs_dir: str,
               reference: str | None, extend: float = 1.0) -> tuple[Config, list[tuple[Arm, int, Config, bool]]]:
    """(base config, [(arm, seed, config, extended), ...]): seed by seed every arm, then the
    extended runs of every arm but the reference (tokens-to-target), all validated."""
    if seeds < 1:
        raise runs.LabError(f"seeds={seeds}: a study needs at least one seed.")
    if not extend >= 1.0:
        raise runs.LabError(f"extend={extend}: must be >= 1 (1: no extended runs).")
    layers = config_layers(base_args)
    base = make_config(*layers)
    seed_list = [base.train.seed + i for i in range(seeds)]
    plan = [(arm, seed, arm_config(layers, arm, seed, runs_dir), False) for seed in seed_list for arm in arms]
    if extend > 1.0:
        plan += [(arm, seed, arm_config(layers, arm, seed, runs_dir, extend=extend), True)
                 for seed in seed_list for arm in arms if arm.name != reference]
    return base, plan


def run_study(
    base_args: Sequence[str],
    arms: Sequence[Arm],
    *,
    seeds: int,
    out_dir: str,
    runs_dir: str | None = None,
    reference: str | None = "bf16",
    make_plots: bool = True,
    curve_window: int = 10,
    extend: float = 1.0,
    margin_percent: float = 1.0,
    devices=None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Trains (or reads back) every arm over `seeds` seeds and writes the study to `out_dir`.

    `base_args` is the command-line form of the base config (`[config.yml] [key=value ...]`);
    seeds run from its `seed` upward. `reference` names the arm the gaps are measured against
    (no gaps when no arm has that name). `extend` > 1 also trains every other arm `extend`
    times longer, for tokens-to-target only. Returns the results (what `results.json` holds);
    raises runs.StudyStopped after writing them when SIGTERM/SIGINT stopped it.
    """
    if curve_window < 1:
        raise runs.LabError(f"curve_window={curve_window}: must be a positive number of steps.")
    if not margin_percent > 0:
        raise runs.LabError(f"margin_percent={margin_percent}: must be > 0 (the TOST margin, percent).")
    runs_dir = runs_dir or os.path.join(out_dir, "runs")
    names = [a.name for a in arms]
    if reference not in names:
        reference = None
    base, plan = plan_study(base_args, arms, seeds=seeds, runs_dir=runs_dir, reference=reference, extend=extend)
    # Every config is built and checked against its directory before anything trains.
    for _, _, cfg, _ in plan:
        runs.check_reusable(_run_directory(cfg), cfg)
    os.makedirs(out_dir, exist_ok=True)
    regular = [p for p in plan if not p[3]]
    study: dict[str, Any] = {
        "steps": base.train.steps,
        "seeds": sorted({seed for _, seed, _, _ in plan}),
        "reference": reference,
        "base_args": list(base_args),
        "arms": [{"name": arm.name, "spec": arm.spec, "config": _arm_note(arm, cfg, base)}
                 for arm, _, cfg, _ in regular[:len(arms)]],
        "seed_note": SEED_NOTE,
        "test": report.TEST,
        "curve_window": curve_window,
        "extend": extend,
        "margin_percent": margin_percent,
        "environment": _environment(),
        "provenance": provenance.record(),
        # The resolved config of every run (only seed and run_name differ across seeds).
        "configs": {cfg.train.run_name: to_dict(cfg) for _, _, cfg, _ in plan},
        "command": _command(base_args, arms, seeds, reference, curve_window, extend, margin_percent),
    }
    results: dict[str, Any] = {"study": study, "summary": [], "runs": [], "extended_runs": []}
    cfg0 = regular[0][2]
    tokens_per_step = cfg0.model.max_target_length * cfg0.train.per_device_batch_size * _device_count(devices)
    study["tokens_per_step"] = tokens_per_step  # what tokens-to-target multiplies by (--check recomputes it)

    def write(final: bool) -> None:
        results["summary"] = report.summarize(names, results["runs"], reference)
        results["analysis"] = analysis.analyze(
            results["runs"] + results["extended_runs"], names, reference, base.train.steps,
            margin_percent=margin_percent, tokens_per_step=tokens_per_step)
        if final and make_plots:
            study["plots"], note = plots.make_plots(results, out_dir, reference)
            if note:
                study["plots_note"] = note
        elif final:
            study["plots"], study["plots_note"] = [], "plots were not asked for"
        report.write_results(os.path.join(out_dir, "results.json"), study, results["runs"], results["summary"],
                             {"analysis": results["analysis"], "extended_runs": results["extended_runs"]})
        report.write_summary(os.path.join(out_dir, "summary.md"), study, results["summary"], results["analysis"])

    # the training loop (jax) loads only when the study trains
    from nvfp4_jax.train import shutdown
    from nvfp4_jax.train.loop import NonFiniteError

    # Between runs the lab's own handler catches the signal; during one, the loop's (it saves
    # and returns "stopped"). Either way no further run starts.
    with shutdown.StopRequest(announce=lambda msg: log(f"[lab] {msg}")) as stop:
        for i, (arm, seed, cfg, extended) in enumerate(plan, 1):
            if stop.requested:
                break
            run_dir = _run_directory(cfg)
            try:
                status = runs.train_or_reuse(cfg, run_dir, devices=devices)
            except NonFiniteError as exc:
                status = f"diverged: {exc}"
            record = {"arm": arm.name, "seed": seed, "status": status, "steps": cfg.train.steps,
                      "extended": extended, "run_directory": os.path.relpath(run_dir, out_dir),
                      **runs.read_run(run_dir, curve_window=curve_window)}
            record["train_tail"] = analysis.tail_mean(record["loss_curve"], cfg.train.steps)
            stopped = status.startswith("stopped")
            if status.startswith("diverged"):
                record["final_eval_loss"] = record["final_eval_loss_bf16"] = None
            where = f"[lab] {i}/{len(plan)} {arm.name}{' (extended)' if extended else ''} seed {seed}"
            if stopped:  # saved at a checkpoint, not finished: not part of the results
                log(f"{where}: {status.replace(':', ' by')} (checkpoint saved; rerun to resume it)")
                stop.signal_name = stop.signal_name or status.split(": ", 1)[1]
                break
            results["extended_runs" if extended else "runs"].append(record)
            loss = record["final_eval_loss"]
            log(f"{where}: {status.split(':')[0]}, final validation loss {'n/a' if loss is None else f'{loss:.4f}'}")
            write(final=False)
        if stop.requested:
            write(final=False)
            log(f"[lab] stopped by {stop.signal_name}: wrote the results so far to "
                f"{os.path.join(out_dir, 'results.json')}; run the same command again to resume.")
            raise runs.StudyStopped(stop.signal_name, results)
    write(final=True)
    plotted = study.get("plots")
    log(f"[lab] wrote {os.path.join(out_dir, 'results.json')}, summary.md"
        + (f" and {len(plotted)} plots" if plotted else f"; plots skipped: {study.get('plots_note')}"))
    return results


def _device_count(devices) -> int:
    # the lab reads runs without jax; only a study that trains loads it
    import jax

    return len(devices) if devices is not None else jax.device_count()


def _command(base_args, arms, seeds, reference, curve_window, extend, margin_percent) -> list[str]:
    """The command line that regenerates this study."""
    cmd = ["python", "-m", "nvfp4_jax.lab", *base_args, "--arms", *[a.spec for a in arms], "--seeds", str(seeds)]
    if reference:
        cmd += ["--reference", reference]
    return cmd + ["--curve_window", str(curve_window), "--extend", f"{extend:g}", "--margin", f"{margin_percent:g}"]
