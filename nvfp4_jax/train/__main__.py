"""`python -m nvfp4_jax.train [--debug] [config.yml] [key=value ...]`: the training entry point.

Exit codes:
  0   the run finished: its final evaluation is recorded (a rerun at the last step only evaluates)
  1   an internal error: a bug, reported with its traceback
  2   something the user can fix, reported as one `error: ...` line before anything compiles:
      config, YAML, data, shapes, output paths, a resume whose config differs from the
      checkpoint's, a run directory locked by another live process
  3   a step went non-finite (loss, gradient norm or state); nothing after the last good
      checkpoint was saved
  4   a checkpoint problem: no intact checkpoint to resume from (all damaged, or the newest
      damaged and checkpoint_fallback=false), or a save that failed (disk full, permission;
      the message names the previous checkpoint, which is intact); also a run-directory file
      (metrics.jsonl, summary.json, config.json) that could not be written, named with the
      intact checkpoint to resume from
  75  stopped by SIGTERM or SIGINT after saving a checkpoint; rerun the same command to resume
      (EX_TEMPFAIL: "try again later"). A second signal ends the process at once, by the signal.

`--debug` (or NVFP4_JAX_DEBUG=1) adds the traceback to the one-line errors.
"""

from __future__ import annotations

import sys

from nvfp4_jax.cli import CommandParser, Exit, debug_requested, fail
from nvfp4_jax.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return Exit.OK
    parser = CommandParser("train", error=ConfigError, config=True, allow_abbrev=False)
    try:
        args, unknown = parser.parse_known_intermixed_args(argv)
        if unknown:
            raise ConfigError(f"Unknown option {unknown[0]!r}; the only option is --debug.")
        cfg = load_config(args.config)
    except ConfigError as exc:
        return fail(exc, debug=debug)

    # Imported only now, so that config errors come back before jax loads.
    from nvfp4_jax.data import DataError
    from nvfp4_jax.train.checkpoint import CheckpointError, silence_abandoned_reads
    from nvfp4_jax.train.loop import NonFiniteError, format_summary, run
    from nvfp4_jax.train.run_dir import RunLockedError, WriteError

    silence_abandoned_reads()  # a damaged checkpoint's error stays the last line
    try:
        summary = run(cfg)
    except (ConfigError, DataError, RunLockedError) as exc:  # mesh errors need the devices first
        return fail(exc, debug=debug)
    except NonFiniteError as exc:
        return fail(exc, Exit.NON_FINITE, debug=debug)
    except (CheckpointError, WriteError) as exc:
        return fail(exc, Exit.NO_CHECKPOINT, debug=debug)
    # config errors come back before jax loads (as above)
    import jax

    if jax.process_index() == 0:
        print(format_summary(summary), flush=True)
    return Exit.STOPPED if summary.get("stopped_by") else Exit.OK


if __name__ == "__main__":
    sys.exit(main())
