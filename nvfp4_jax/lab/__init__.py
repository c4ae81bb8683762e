"""Convergence lab: the NVFP4 paper's comparisons in miniature (`python -m nvfp4_jax.lab`).

    arms.py     arm specs (`name:key=value,...`), the default arms, an arm's config
    runs.py     one (arm, seed) run: train, resume or read back its run directory
    stats.py    t-tests, t and bootstrap intervals, Holm, sign test, TOST (numpy, no scipy)
    analysis.py the metrics (train-loss tail, both validation losses, tokens to target) and the
                comparisons worded from the corrected statistics
    provenance.py  commit, dirty flag, package versions, device
    check.py    --check (re-derive the file's numbers, re-run one run bit for bit) and --analyze
    report.py   the summary over seeds, results.json, summary.md
    plots.py    loss curves, gaps to the reference, quantization-health heat maps (matplotlib)
    study.py    run_study: every arm over every seed, then the report
"""

from nvfp4_jax.lab.arms import DEFAULT_ARMS, Arm, parse_arm, parse_arms
from nvfp4_jax.lab.study import run_study

__all__ = ["DEFAULT_ARMS", "Arm", "parse_arm", "parse_arms", "run_study"]
