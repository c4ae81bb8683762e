"""`python -m nvfp4_jax.lab [config.yml] [key=value ...] [--arms ARM ...] [--seeds N] [--out DIR]`

Trains every arm for `steps` steps over N seeds and writes results.json, summary.md and PNGs to
DIR. Running the same command again reads finished runs back and resumes interrupted ones.
"""

from __future__ import annotations

import argparse
import sys

from nvfp4_jax.config import ConfigError
from nvfp4_jax.lab.arms import DEFAULT_ARMS, parse_arms


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nvfp4_jax.lab",
        description="Convergence lab: train each arm over several seeds on the same data, compare "
                    "their validation losses to the reference arm, plot the curves and the "
                    "quantization health. Rerunning resumes.",
    )
    p.add_argument("config", nargs="*", help="base config: [config.yml] [key=value ...] (as nvfp4_jax.train)")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), metavar="ARM",
                   help="arms as name or name:key=value,key=value (default: the paper's nine comparisons)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per arm, counting up from the config's seed (default 3)")
    p.add_argument("--out", default="runs/lab", help="results folder (default runs/lab)")
    p.add_argument("--runs_dir", default=None, help="where the run directories go (default OUT/runs)")
    p.add_argument("--reference", default="bf16", help="the arm gaps are measured against (default bf16)")
    p.add_argument("--curve_window", type=int, default=10, help="steps per point of the stored loss curves (default 10)")
    p.add_argument("--no_plots", action="store_true", help="write results.json and summary.md only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from nvfp4_jax.data import DataError
    from nvfp4_jax.lab.runs import LabError
    from nvfp4_jax.lab.study import run_study
    from nvfp4_jax.train.run_dir import RunLockedError

    try:
        run_study(
            args.config, parse_arms(args.arms), seeds=args.seeds, out_dir=args.out,
            runs_dir=args.runs_dir, reference=args.reference, make_plots=not args.no_plots,
            curve_window=args.curve_window,
        )
    except (ConfigError, DataError, LabError, RunLockedError) as exc:
        # RunLockedError: another lab (or training run) is training one of these runs now.
        print(f"lab error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
