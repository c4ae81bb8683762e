"""A study's PNGs (matplotlib, the optional `plot` extra).

- `loss_curves.png`: train loss per arm (mean over seeds, band from the lowest to the highest
  seed) and the validation losses at the evaluation steps (mean, bars from lowest to highest);
- `gap_to_<reference>.png`: each arm's relative gap to the reference arm over training, seed by
  seed (same seed: same initial weights and batches), mean with the min-max band;
- `quant_health.png`: every arm's mean quantization error and zero fraction per operand;
- `quant_health_<arm>.png`: per arm, one heat map per statistic, projections (by layer) x operands,
  at the last evaluation that measured them, mean over seeds. Blank cells: not quantized there.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

from nvfp4_jax.quant.health import layer_index

OPERAND_ORDER = ("x", "w", "dy", "w_dgrad", "x_wgrad", "dy_wgrad")
STAT_ORDER = ("error", "zero_frac", "scale_zero_frac", "scale_subnormal_frac", "scale_max_frac",
              "saturated_frac", "amax")
MISSING = "matplotlib is not installed (pip install 'nvfp4_jax[plot]')"


def _pyplot():
    # optional dependency (matplotlib)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_arm(results: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {row["arm"]: [] for row in results["summary"]}
    for run in results["runs"]:
        out.setdefault(run["arm"], []).append(run)
    return out


def _stack(curves: Sequence[Sequence[Sequence[float]]]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values[seed, step]) on the steps every curve has."""
    common = sorted(set.intersection(*[{p[0] for p in c} for c in curves])) if curves else []
    lookup = [dict((p[0], p[1]) for p in c) for c in curves]
    return np.array(common), np.array([[d[s] for s in common] for d in lookup]).reshape(len(curves), len(common))


def _colors(arms: Sequence[str]) -> dict[str, Any]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    return {arm: cmap(i % 10) for i, arm in enumerate(arms)}


def loss_curves(results: dict, path: str) -> str:
    plt = _pyplot()
    by_arm = _by_arm(results)
    colors = _colors(list(by_arm))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for arm, runs in by_arm.items():
        curves = [r["loss_curve"] for r in runs if r.get("loss_curve")]
        if curves:
            steps, values = _stack(curves)
            left.plot(steps, values.mean(0), color=colors[arm], label=arm, lw=1.2)
            left.fill_between(steps, values.min(0), values.max(0), color=colors[arm], alpha=0.2, lw=0)
        evals = [r["eval_losses"] for r in runs if r.get("eval_losses")]
        if evals:
            steps, values = _stack(evals)
            mean = values.mean(0)
            right.errorbar(steps, mean, yerr=[mean - values.min(0), values.max(0) - mean],
                           color=colors[arm], label=arm, marker="o", ms=3, capsize=2, lw=1)
    left.set(xlabel="step", ylabel="train loss (nats)", yscale="log",
             title="Train loss (window means; band: seed min-max)")
    right.set(xlabel="step", ylabel="validation loss (nats)",
              title="Validation loss (mean; bars: seed min-max)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    # The interesting part is the end of training: start the right panel after the first eval.
    steps = sorted({p[0] for r in results["runs"] for p in r.get("eval_losses") or []})
    if len(steps) > 2:
        tail = [p[1] for r in results["runs"] for p in r.get("eval_losses") or [] if p[0] >= steps[1]]
        right.set_xlim(steps[1] - 0.02 * steps[-1], steps[-1] * 1.02)
        right.set_ylim(min(tail) - 0.01, max(tail) + 0.01)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def gap_curves(results: dict, reference: str, path: str) -> str:
    plt = _pyplot()
    by_arm = _by_arm(results)
    colors = _colors(list(by_arm))
    ref_runs = {r["seed"]: r for r in by_arm.get(reference, [])}
    last = max((p[0] for r in results["runs"] for p in r.get("loss_curve") or []), default=0)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    shown: list[float] = []  # the left panel's values after the first 10% of training
    for arm, runs in by_arm.items():
        if arm == reference:
            continue
        for ax, key in ((left, "loss_curve"), (right, "eval_losses")):
            pairs = [(r[key], ref_runs[r["seed"]][key]) for r in runs
                     if r["seed"] in ref_runs and r.get(key) and ref_runs[r["seed"]].get(key)]
            if not pairs:
                continue
            steps, values = _stack([a for a, _ in pairs] + [b for _, b in pairs])
            ours, ref = values[:len(pairs)], values[len(pairs):]
            gap = 100.0 * (ours - ref) / ref
            style = dict(marker="o", ms=3) if key == "eval_losses" else {}
            ax.plot(steps, gap.mean(0), color=colors[arm], label=arm, lw=1.2, **style)
            ax.fill_between(steps, gap.min(0), gap.max(0), color=colors[arm], alpha=0.15, lw=0)
            if key == "loss_curve":
                shown += list(gap.mean(0)[steps >= 0.1 * last])
    left.set(xlabel="step", ylabel=f"gap to {reference} (%)",
             title=f"Train loss vs {reference}, same seed (mean; band: seed min-max)")
    right.set(xlabel="step", ylabel=f"gap to {reference} (%)",
              title=f"Validation loss vs {reference}, same seed")
    for ax in (left, right):
        ax.axhline(0.0, color="black", lw=0.8)
        ax.grid(alpha=0.3)
    # The first steps' gaps are large and say little: show the range after 10% of training.
    if shown:
        pad = 0.15 * (max(shown) - min(shown) + 1e-3)
        left.set_xlim(0.1 * last, last * 1.01)
        left.set_ylim(min(min(shown), 0.0) - pad, max(shown) + pad)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def mean_health(runs: Sequence[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """{projection: {operand: {stat: mean over the runs that measured it}}}."""
    sums: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        for proj, operands in (run.get("quant_stats") or {}).items():
            for op, values in operands.items():
                for stat, v in values.items():
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        sums.setdefault((proj, op, stat), []).append(float(v))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (proj, op, stat), vs in sums.items():
        out.setdefault(proj, {}).setdefault(op, {})[stat] = sum(vs) / len(vs)
    return out


def _mean_or_nan(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _row_order(projections) -> list[str]:
    return sorted(projections, key=lambda p: (layer_index(p) is None, layer_index(p) or 0, p))


def _ordered(names, order) -> list[str]:
    return [n for n in order if n in names] + sorted(set(names) - set(order))


def _heatmap(ax, grid: np.ndarray, rows, cols, title: str, log: bool = False) -> None:
    plt = _pyplot()
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("#dddddd")
    shown = np.log10(np.where(grid > 0, grid, np.nan)) if log else grid
    masked = np.ma.masked_invalid(shown)
    image = ax.imshow(masked, cmap=cmap, aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=30, fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_title(title, fontsize=9)
    plt.colorbar(image, ax=ax, fraction=0.046, pad=0.02)
    for (i, j), v in np.ndenumerate(grid):
        if math.isfinite(v):
            text = f"{v:.2g}" if (v == 0 or 1e-2 <= abs(v) < 1e3) else f"{v:.0e}"
            ax.text(j, i, text, ha="center", va="center", fontsize=6, color="white")


def health_heatmaps(results: dict, out_dir: str) -> list[str]:
    plt = _pyplot()
    by_arm = _by_arm(results)
    health = {arm: mean_health(runs) for arm, runs in by_arm.items()}
    health = {arm: h for arm, h in health.items() if h}
    if not health:
        return []
    rows = _row_order({p for h in health.values() for p in h})
    cols = _ordered({op for h in health.values() for ops in h.values() for op in ops}, OPERAND_ORDER)
    files = []
    for arm, h in health.items():
        present = _ordered({s for ops in h.values() for v in ops.values() for s in v}, STAT_ORDER)
        fig, axes = plt.subplots(1, len(present), figsize=(3.3 * len(present), 0.35 * len(rows) + 2))
        for ax, stat in zip(np.atleast_1d(axes), present):
            grid = np.array([[h.get(p, {}).get(op, {}).get(stat, np.nan) for op in cols] for p in rows])
            label = "log10 amax" if stat == "amax" else stat
            _heatmap(ax, grid, rows if ax is np.atleast_1d(axes)[0] else [""] * len(rows), cols, label,
                     log=stat == "amax")
        step = sorted({r.get("quant_stats_step") for r in by_arm[arm] if r.get("quant_stats_step")})
        fig.suptitle(f"{arm}: quantization health at step {step[-1] if step else '?'} "
                     f"(mean over {len(by_arm[arm])} seeds; grey: not quantized)", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"quant_health_{arm}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        files.append(path)

    arms = list(health)
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(arms) + 2))
    for ax, stat in zip(axes, ("error", "zero_frac")):
        grid = np.array([
            [_mean_or_nan([health[a][p][op][stat] for p in health[a] if op in health[a][p]]) for op in cols]
            for a in arms
        ])
        _heatmap(ax, grid, arms, cols, f"{stat}, mean over projections")
    fig.tight_layout()
    path = os.path.join(out_dir, "quant_health.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path] + files


def make_plots(results: dict, out_dir: str, reference: str | None) -> tuple[list[str], str | None]:
    """Writes every PNG; returns (file names, None), or ([], why) when plotting is unavailable."""
    try:
        _pyplot()
    except ImportError:
        return [], MISSING
    files = [loss_curves(results, os.path.join(out_dir, "loss_curves.png"))]
    if reference and any(r["arm"] == reference for r in results["runs"]):
        files.append(gap_curves(results, reference, os.path.join(out_dir, f"gap_to_{reference}.png")))
    files += health_heatmaps(results, out_dir)
    return [os.path.basename(f) for f in files], None
