"""Convergence lab: the NVFP4 paper's comparisons in miniature (`python -m nvfp4_jax.lab`).

    arms.py     arm specs (`name:key=value,...`), the default arms, an arm's config
    runs.py     one (arm, seed) run: train, resume or read back its run directory
    stats.py    mean, std, Welch and paired t-tests (no scipy)
    report.py   the summary over seeds, results.json, summary.md
    plots.py    loss curves, gaps to the reference, quantization-health heat maps (matplotlib)
    study.py    run_study: every arm over every seed, then the report
"""

from nvfp4_jax.lab.arms import DEFAULT_ARMS, Arm, parse_arm, parse_arms
from nvfp4_jax.lab.study import run_study

__all__ = ["DEFAULT_ARMS", "Arm", "parse_arm", "parse_arms", "run_study"]
