"""One (arm, seed) run of a study: train it, or read it back from its run directory.

A run directory holds what `nvfp4_jax.train.loop.run` writes: `config.json` (at the start),
`metrics.jsonl` (one JSON object per line, appended as the run goes), `summary.json` (at the
end) and `checkpoints/`. A run whose directory has the same config and a summary is finished and
only read back, once its files bear out the summary (`check_reusable`; else LabError); one with the same config and no summary was interrupted and is run again, which
resumes it from its latest checkpoint. A directory holding a different config is an error: the
lab never trains over someone else's run.

Runs are read through `nvfp4_jax.train.run_dir` (a last metrics line cut short by a kill is
skipped there); unknown keys and records are ignored, and a step logged twice (a resumed run
repeats the steps after its last checkpoint) keeps its last record.
"""

from __future__ import annotations

from typing import Any

from nvfp4_jax.config import KEY_SECTIONS, Config, ConfigError, from_dict, to_dict
from nvfp4_jax.train import run_dir as run_dir_lib
from nvfp4_jax.train.resume import LOCATION_KEYS, config_differences


class LabError(RuntimeError):
    """A study that cannot go on as asked (e.g. a run directory holding another config)."""


class StudyStopped(Exception):
    """SIGTERM/SIGINT stopped the study: the current run saved, no further run started, the
    results so far are written. Rerunning the same command resumes it."""

    def __init__(self, signal_name: str, results: dict):
        super().__init__(f"stopped by {signal_name}")
        self.signal_name, self.results = signal_name, results


def config_changes(saved: dict, cfg: Config) -> list[str]:
    """`section.key: saved -> wanted` for every key (location aside) where `saved` differs from
    `cfg`; a saved config the current code cannot read is one difference. The saved config is
    read through the current defaults first, so a key added since compares as its default."""
    try:
        saved = to_dict(from_dict(saved))
    except ConfigError as exc:
        return [f"the saved config cannot be read ({exc})"]
    return [f"{KEY_SECTIONS.get(key, '?')}.{key}: {old!r} -> {new!r}"
            for key, old, new in config_differences(saved, cfg, ignore=LOCATION_KEYS)]


def metric_series(run_dir: str) -> dict[str, dict[int, Any]]:
    """{"loss": {step: train loss}, "eval_loss": {step: loss}, "eval_loss_bf16": {step: loss},
    "quant_stats": {step: stats}} of a run directory; a step logged twice keeps its last record."""
    records = run_dir_lib.read_metrics(run_dir)
    return {key: dict(run_dir_lib.iter_steps(records, key))
            for key in ("loss", "eval_loss", "eval_loss_bf16", "quant_stats")}


def is_finished(run_dir: str, cfg: Config) -> bool:
    """Finished (run_dir.is_finished) and evaluated the way this config asks: a run from before
    the evaluation modes has no BF16 evaluation, so a lab asking for one completes it."""
    if not run_dir_lib.is_finished(run_dir, cfg.train.steps):
        return False
    return cfg.train.eval_quantization == "train" or (run_dir_lib.read_summary(run_dir) or {}).get(
        "final_eval_loss_bf16") is not None


def check_reusable(run_dir: str, cfg: Config) -> None:
    """Raises LabError when `run_dir` holds a run of a config other than `cfg`, or a finished
    run whose files do not bear out its summary (`run_dir.finished_run_problems`: metrics.jsonl
    deleted, short of a step, its last line cut, no final evaluation, a summary that disagrees):
    reading it back would report numbers its files do not hold."""
    saved = run_dir_lib.read_config(run_dir)
    if saved is not None:
        diffs = config_changes(saved, cfg)
        if diffs:
            raise LabError(
                f"{run_dir} holds a run of another config ({'; '.join(diffs)}): remove that directory "
                "or choose another results folder."
            )
    if is_finished(run_dir, cfg):
        problems = run_dir_lib.finished_run_problems(run_dir)
        if problems:
            raise LabError(
                f"{run_dir}: the finished run {cfg.train.run_name} cannot be reused: {'; '.join(problems)}. "
                "Remove that directory to train it again (or restore its files)."
            )


def train_or_reuse(cfg: Config, run_dir: str, *, devices=None) -> str:
    """Makes sure the run of `cfg` in `run_dir` is finished: "reused" when it already was,
    "resumed" when an interrupted run was continued (a run without its final evaluation is
    unfinished: it is completed), "trained" when it started from nothing, "stopped: <signal>" when a
    SIGTERM/SIGINT stopped it at a checkpoint (rerunning resumes it)."""
    check_reusable(run_dir, cfg)
    if is_finished(run_dir, cfg):
        return "reused"
    started = run_dir_lib.read_config(run_dir) is not None
    from nvfp4_jax.train.loop import run  # jax is imported only when something trains

    summary = run(cfg, progress=False, devices=devices)
    if summary.get("stopped_by"):
        return f"stopped: {summary['stopped_by']}"
    return "resumed" if started else "trained"


def _windowed(losses: dict[int, float], window: int) -> list[list[float]]:
    """[[last step of the window, mean loss of the window], ...] over consecutive windows."""
    steps = sorted(losses)
    out = []
    for start in range(0, len(steps), window):
        chunk = steps[start:start + window]
        out.append([chunk[-1], sum(losses[s] for s in chunk) / len(chunk)])
    return out


def read_run(run_dir: str, *, curve_window: int = 10) -> dict[str, Any]:
    """What a study keeps of a finished run: the train-loss curve (means over windows of
    `curve_window` steps), the eval losses (recipe and BF16 forward), the final validation
    losses, tokens/s, and the
    quantization statistics of the last evaluation that measured them."""
    summary = run_dir_lib.read_summary(run_dir) or {}
    metrics = metric_series(run_dir)
    stats = metrics["quant_stats"]
    last = max(stats) if stats else None
    return {
        "loss_curve": _windowed(metrics["loss"], curve_window),
        "eval_losses": [[s, metrics["eval_loss"][s]] for s in sorted(metrics["eval_loss"])],
        "eval_losses_bf16": [[s, metrics["eval_loss_bf16"][s]] for s in sorted(metrics["eval_loss_bf16"])],
        "final_eval_loss": summary.get("final_eval_loss"),
        "final_eval_loss_bf16": summary.get("final_eval_loss_bf16"),
        "tokens_per_second_per_device": summary.get("median_tokens_per_second_per_device"),
        "median_step_seconds": summary.get("median_step_seconds"),
        "quant_stats_step": last,
        "quant_stats": stats[last] if last is not None else None,
    }
