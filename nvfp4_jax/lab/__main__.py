"""`python -m nvfp4_jax.lab [config.yml] [key=value ...] [--arms ARM ...] [--seeds N] [--out DIR]`

Trains every arm for `steps` steps over N seeds and writes results.json, summary.md and PNGs to
DIR. Running the same command again reads finished runs back and resumes interrupted ones.
SIGTERM/SIGINT stops the study like a run (the current run saves, no further one starts, the
results so far are written) with exit status 75; rerunning resumes it.

`--check results.json [--run NAME]` re-runs one recorded run and reports whether it reproduces
bit for bit (exit 0) or not (exit 6); derived numbers (train tails, summary, analysis) that the
file's curves and final losses do not give fail it (exit 6, each named) before anything trains.
Exit 1 is a crash (a bug), with its traceback.
Bad input (arguments, a results.json missing a field, a metrics.jsonl line that is not JSON) is one
`error: ...` line with exit status 2. `--analyze results.json [--stats_out FILE]` recomputes the
statistics of an existing study with this code.
"""

from __future__ import annotations

import os
import sys

from nvfp4_jax.cli import CommandParser, Exit, debug_requested, fail
from nvfp4_jax.config import ConfigError
from nvfp4_jax.lab.arms import DEFAULT_ARMS, parse_arms


def _parser() -> CommandParser:
    p = CommandParser(
        "lab", error=ConfigError, config=True, help=True,
        description="Convergence lab: train each arm over several seeds on the same data, compare "
                    "them with the reference arm (training-loss tail, validation through the recipe "
                    "and through BF16, tokens to a target loss) with confidence intervals and "
                    "corrected p-values, plot the curves and the quantization health. Rerunning resumes.",
    )
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), metavar="ARM",
                   help="arms as name or name:key=value,key=value (default: the paper's comparisons)")
    p.add_argument("--seeds", type=int, default=5, help="seeds per arm, counting up from the config's seed (default 5)")
    p.add_argument("--out", default="runs/lab", help="results folder (default runs/lab)")
    p.add_argument("--runs_dir", default=None, help="where the run directories go (default OUT/runs)")
    p.add_argument("--reference", default="bf16", help="the arm gaps are measured against (default bf16)")
    p.add_argument("--curve_window", type=int, default=10, help="steps per point of the stored loss curves (default 10)")
    p.add_argument("--extend", type=float, default=1.0,
                   help="also train every non-reference arm this many times longer, for tokens-to-target "
                        "only (default 1: no extra runs; e.g. 1.5)")
    p.add_argument("--margin", type=float, default=1.0,
                   help="equivalence margin of the TOST test, percent of the compared-with arm (default 1)")
    p.add_argument("--no_plots", action="store_true", help="write results.json and summary.md only")
    p.add_argument("--check", metavar="RESULTS_JSON", help="re-run one run of that study and compare bit for bit")
    p.add_argument("--run", default=None, help="with --check: which run (ARM-seedN; default the first finished)")
    p.add_argument("--analyze", metavar="RESULTS_JSON", help="recompute that study's statistics with this code")
    p.add_argument("--stats_out", default=None,
                   help="with --analyze: where to write them (default statistics.json beside RESULTS_JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    try:
        args = _parser().parse_args(argv)
    except ConfigError as exc:
        return fail(exc, debug=debug)
    # after argparse: usage errors and --help come back before anything heavy loads
    from nvfp4_jax.data import DataError
    from nvfp4_jax.lab.runs import LabError, StudyStopped
    from nvfp4_jax.train.run_dir import MetricsError, RunLockedError

    try:
        if args.check and args.analyze:
            raise LabError("--check and --analyze: choose one.")
        if args.check:
            # check trains one run: jax only on this path
            from nvfp4_jax.lab.check import check

            return Exit.OK if check(args.check, which=args.run) else Exit.NOT_REPRODUCED
        if args.analyze:
            # the analysis path: no jax
            from nvfp4_jax.lab.check import reanalyze

            if not args.margin > 0:
                raise LabError(f"--margin {args.margin}: must be > 0 (percent).")
            out = args.stats_out or os.path.join(os.path.dirname(args.analyze) or ".", "statistics.json")
            reanalyze(args.analyze, out, margin_percent=args.margin)
            print(f"[lab] wrote {out}")
            return Exit.OK
        # jax loads only when a study trains (--check/--analyze do without it)
        from nvfp4_jax.lab.study import run_study

        run_study(
            args.config, parse_arms(args.arms), seeds=args.seeds, out_dir=args.out,
            runs_dir=args.runs_dir, reference=args.reference, make_plots=not args.no_plots,
            curve_window=args.curve_window, extend=args.extend, margin_percent=args.margin,
        )
    except StudyStopped:
        return Exit.STOPPED
    except (ConfigError, DataError, LabError, MetricsError, RunLockedError) as exc:
        # RunLockedError: another lab (or training run) is training one of these runs now.
        # MetricsError: a run's metrics.jsonl holds a line that is not a record (file and line named).
        return fail(exc, debug=debug)
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
