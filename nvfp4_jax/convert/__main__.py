"""`python -m nvfp4_jax.convert` — checkpoints in and out of Hugging Face Llama.

  from-hf HF_DIR OUT [model_name=...] [scan_layers=true|false] [bf16_first_layers=N] [bf16_last_layers=N]
      HF_DIR holds config.json and model.safetensors (or shards with model.safetensors.index.json).
      OUT becomes a parameters checkpoint in the layout the key=value pairs choose (give the ones
      you will train with); train from it with load_parameters_path=OUT.
  to-hf SRC OUT [--dtype float32|bfloat16] [--max-shard-bytes N]
      SRC is a run directory (its newest intact checkpoint, verified), one of its
      checkpoints/<step> folders, or a parameters checkpoint. OUT gets config.json and
      safetensors that transformers.LlamaForCausalLM.from_pretrained(OUT) loads.

Exit codes: 0 done; 2 something the user can fix, as one `error: ...` line (`--debug`, or
NVFP4_JAX_DEBUG=1, adds its traceback); 1 an internal error.
"""

from __future__ import annotations

import sys

from nvfp4_jax.cli import Exit, debug_requested, fail


def _options(args: list[str], allowed: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Splits `--name value` / `--name=value` options (names in `allowed`) from positionals."""
    positional, options = [], {}
    it = iter(args)
    for arg in it:
        if not arg.startswith("--"):
            positional.append(arg)
            continue
        name, sep, value = arg[2:].partition("=")
        if name not in allowed:
            raise ValueError(f"Unknown option {arg!r}; to-hf takes {', '.join('--' + k for k in allowed)}.")
        if not sep:
            value = next(it, None)
            if value is None:
                raise ValueError(f"Option --{name} needs a value ({allowed[name]}).")
        options[name] = value
    return positional, options


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    if not argv:
        return fail("No command; choose from-hf or to-hf (python -m nvfp4_jax.convert --help).")
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        return Exit.OK
    command, args = argv[0], argv[1:]
    # Imported only now: no command and --help answer before jax and the model load.
    from nvfp4_jax.config import ConfigError, parse_overrides
    from nvfp4_jax.convert.checkpoints import from_hf, to_hf
    from nvfp4_jax.convert.hf import ConvertError
    from nvfp4_jax.train.checkpoint import CheckpointError

    try:
        if command == "from-hf":
            if len(args) < 2 or any(a.startswith("--") for a in args):
                raise ValueError("from-hf needs HF_DIR OUT [key=value ...] (see --help).")
            m = from_hf(args[0], args[1], parse_overrides(args[2:]))
            print(f"wrote a parameters checkpoint of {m.base_num_decoder_layers} layers "
                  f"(scan_layers={str(m.scan_layers).lower()}) to {args[1]}; train from it with "
                  f"load_parameters_path={args[1]}")
        elif command == "to-hf":
            positional, options = _options(args, {"dtype": "float32 or bfloat16", "max-shard-bytes": "bytes"})
            if len(positional) != 2:
                raise ValueError("to-hf needs SRC OUT [--dtype float32|bfloat16] [--max-shard-bytes N].")
            shard = options.get("max-shard-bytes", str(5 * 2**30))
            if not shard.isdigit():
                raise ValueError(f"--max-shard-bytes={shard!r} must be a positive whole number of bytes.")
            try:
                to_hf(positional[0], positional[1], dtype=options.get("dtype", "float32"),
                      max_shard_bytes=int(shard))
            except CheckpointError as exc:
                raise ConvertError(str(exc)) from None
            print(f"wrote config.json and safetensors to {positional[1]}")
        else:
            raise ValueError(f"Unknown command {command!r}; choose from-hf or to-hf (see --help).")
    except (ValueError, ConfigError, ConvertError) as exc:
        return fail(exc, debug=debug)
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
