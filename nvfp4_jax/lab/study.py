"""A study: every arm trained over every seed from one base config, then compared.

Runs go seed by seed (all arms of seed 0, then of seed 1, ...), so a study cut short still
compares every arm. Each run lives in `<runs_dir>/<arm>-seed<seed>/`; finished runs are read
back, interrupted ones resumed (see `runs`). `results.json` and `summary.md` are rewritten after
every run, the plots at the end.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Callable, Sequence

from nvfp4_jax.config import Config, config_layers, make_config
from nvfp4_jax.lab import plots, report, runs
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
    import jax

    return {"jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()}


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
    devices=None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Trains (or reads back) every arm over `seeds` seeds and writes the study to `out_dir`.

    `base_args` is the command-line form of the base config (`[config.yml] [key=value ...]`);
    seeds run from its `seed` upward. `reference` names the arm the gaps are measured against
    (no gaps when no arm has that name). Returns the results (what `results.json` holds).
    """
    if seeds < 1:
        raise runs.LabError(f"seeds={seeds}: a study needs at least one seed.")
    if curve_window < 1:
        raise runs.LabError(f"curve_window={curve_window}: must be a positive number of steps.")
    layers = config_layers(base_args)
    base = make_config(*layers)
    seed_list = [base.train.seed + i for i in range(seeds)]
    runs_dir = runs_dir or os.path.join(out_dir, "runs")
    # Every config is built and checked against its directory before anything trains.
    plan = [(arm, seed, arm_config(layers, arm, seed, runs_dir)) for seed in seed_list for arm in arms]
    for _, _, cfg in plan:
        runs.check_reusable(_run_directory(cfg), cfg)
    os.makedirs(out_dir, exist_ok=True)
    names = [a.name for a in arms]
    if reference not in names:
        reference = None
    study: dict[str, Any] = {
        "steps": base.train.steps,
        "seeds": seed_list,
        "reference": reference,
        "base_args": list(base_args),
        "arms": [{"name": arm.name, "spec": arm.spec, "config": _arm_note(arm, cfg, base)}
                 for arm, _, cfg in plan[:len(arms)]],
        "seed_note": SEED_NOTE,
        "test": report.TEST,
        "curve_window": curve_window,
        "environment": _environment(),
    }
    results: dict[str, Any] = {"study": study, "summary": [], "runs": []}

    def write(final: bool) -> None:
        results["summary"] = report.summarize(names, results["runs"], reference)
        if final and make_plots:
            study["plots"], note = plots.make_plots(results, out_dir, reference)
            if note:
                study["plots_note"] = note
        elif final:
            study["plots"], study["plots_note"] = [], "plots were not asked for"
        report.write_results(os.path.join(out_dir, "results.json"), study, results["runs"], results["summary"])
        report.write_summary(os.path.join(out_dir, "summary.md"), study, results["summary"])

    from nvfp4_jax.train.loop import NonFiniteError

    for i, (arm, seed, cfg) in enumerate(plan, 1):
        run_dir = _run_directory(cfg)
        try:
            status = runs.train_or_reuse(cfg, run_dir, devices=devices)
        except NonFiniteError as exc:
            status = f"diverged: {exc}"
        record = {"arm": arm.name, "seed": seed, "status": status,
                  "run_directory": os.path.relpath(run_dir, out_dir),
                  **runs.read_run(run_dir, curve_window=curve_window)}
        if status.startswith("diverged"):
            record["final_eval_loss"] = None
        results["runs"].append(record)
        loss = record["final_eval_loss"]
        log(f"[lab] {i}/{len(plan)} {arm.name} seed {seed}: {status.split(':')[0]}, "
            f"final validation loss {'n/a' if loss is None else f'{loss:.4f}'}")
        write(final=False)
    write(final=True)
    plotted = study.get("plots")
    log(f"[lab] wrote {os.path.join(out_dir, 'results.json')}, summary.md"
        + (f" and {len(plotted)} plots" if plotted else f"; plots skipped: {study.get('plots_note')}"))
    return results
