"""`python -m nvfp4_jax.train [config.yml] [key=value ...]`: the training entry point."""

from __future__ import annotations

import sys

from nvfp4_jax.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(argv)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    from nvfp4_jax.train.loop import NonFiniteLossError, format_summary, run

    try:
        summary = run(cfg)
    except NonFiniteLossError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except ConfigError as exc:  # mesh errors are found once the devices are known
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    import jax

    if jax.process_index() == 0:
        print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
