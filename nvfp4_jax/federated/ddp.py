"""Data parallel training with per-process shares of a fixed global batch, from the command line
(the numerics are `shares.py`, the design docs/scaling.md):

  python -m nvfp4_jax.federated.ddp --processes P [options] [config.yml] [key=value ...]

starts P processes on this machine on JAX's distributed runtime (one worker each, CPU collectives
over gloo), every step each trains its share of the run's global batch (`per_device_batch_size`
rows, cut into microbatches of --microbatch rows), the gradient is the global batch's
token-weighted mean, and every --period steps the controller re-splits the microbatches from the
workers' measured per-sample times (--policy equal | static | adaptive; EMA, deadband, at least one
microbatch per worker). Process 0 prints the decisions and writes them, with the per-step losses,
to <run dir>/shares.json after every period, beside the state it resumes from.

  --processes P        workers (>= 1)
  --steps S            training steps (default 8)
  --period N           steps between re-splits (default 2)
  --microbatch M       rows per microbatch; per_device_batch_size must be a multiple of it, with
                       at least one microbatch per worker (default 1)
  --policy NAME        equal | static (re-split once, after the first period) | adaptive (default)
  --slowdown F,...     experiments: worker i's compute is stretched by F_i (>= 1; sleeping, as the
                       federated sites do); one value per worker (default: all 1)
  --slowdown-from K    the slowdowns start at step K (a worker that slows down mid-run; default 0)
  --resume             continue the run in the run directory from its last period: its state,
                       split and smoothed costs (the losses go on exactly as without the stop)
  --debug              the traceback above an error line

Quantized runs (te_nvfp4, FP8 current scaling) key each microbatch's stochastic rounding by its
position in the global batch (`shares.microbatch_key`); delayed-scaling FP8 is refused. Not done:
several devices per process, one GPU per process (the workers see the same devices).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

from nvfp4_jax.cli import CommandParser, Exit, debug_requested, fail, parse_command
from nvfp4_jax.config import ConfigError, load_config
from nvfp4_jax.federated.budget import POLICIES
from nvfp4_jax.quant.recipe import get_recipe

SHARES_LOG = "shares.json"


def _parser() -> CommandParser:
    p = CommandParser("federated.ddp", error=ConfigError, config=True)
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--period", type=int, default=2)
    p.add_argument("--microbatch", type=int, default=1)
    p.add_argument("--policy", default="adaptive")
    p.add_argument("--slowdown", default="")
    p.add_argument("--slowdown-from", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    return p


def check(args) -> tuple[object, list[float], int]:
    """(config, slowdown per worker, microbatches per step) of valid arguments; ConfigError (one
    line, naming the value and what is allowed) otherwise."""
    if args.processes < 1:
        raise ConfigError(f"--processes={args.processes} must be at least 1")
    for name in ("steps", "period", "microbatch"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name}={getattr(args, name)} must be at least 1")
    if args.slowdown_from < 0:
        raise ConfigError(f"--slowdown-from={args.slowdown_from} must be >= 0")
    if args.policy not in POLICIES:
        raise ConfigError(f"--policy={args.policy!r} is not allowed: one of {', '.join(POLICIES)}")
    try:
        slowdown = [float(x) for x in args.slowdown.split(",")] if args.slowdown else [1.0] * args.processes
    except ValueError:
        raise ConfigError(f"--slowdown={args.slowdown!r} must be {args.processes} comma-separated numbers") from None
    if len(slowdown) != args.processes or not all(f >= 1.0 for f in slowdown):
        raise ConfigError(f"--slowdown={args.slowdown!r} must be {args.processes} factors (one per worker), each >= 1")
    cfg = load_config(args.config)
    delayed = [(key, flag) for key, flag in (("quantization", cfg.model.quantization),
                                              ("vision_quantization", cfg.model.vision_quantization))
               if flag and get_recipe(flag).fp8_delayed]
    if delayed:
        key, flag = delayed[0]
        raise ConfigError(f"{key}={flag}: delayed scaling keeps amax histories that the shares step does not "
                          f"update or combine across workers; use te_fp8_currentscaling, te_nvfp4 or bf16")
    rows = cfg.train.per_device_batch_size
    shown = int(rows) if rows == int(rows) else rows
    if rows != int(rows) or int(rows) % args.microbatch:
        raise ConfigError(f"per_device_batch_size={shown} (the global batch here) must be a multiple of "
                          f"--microbatch={args.microbatch}")
    microbatches = int(rows) // args.microbatch
    if microbatches < args.processes:
        raise ConfigError(f"per_device_batch_size={shown} / --microbatch={args.microbatch} = {microbatches} "
                          f"microbatches cannot give each of --processes={args.processes} workers one")
    return cfg, slowdown, microbatches


def run_directory(cfg) -> str:
    return os.path.abspath(os.path.join(cfg.train.base_output_directory, cfg.train.run_name))


def equal_split(microbatches: int, processes: int) -> list[int]:
    return [microbatches // processes + (i < microbatches % processes) for i in range(processes)]


# --- the decision log and the state a resume continues from ------------------------------------

def _write_atomically(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a kill leaves the old file or the new one, never half of one


def save_progress(run_dir: str, progress, losses: list[float], header: dict) -> None:
    """The state after `progress.step` steps (its own file, named by the step), then the log that
    points at it: a kill between the two leaves the previous pair whole."""
    # flax (with jax) only in the workers: the launcher checks its arguments without jax
    from flax import serialization

    state_file = f"ddp_state_{progress.step}.msgpack"
    _write_atomically(os.path.join(run_dir, state_file), serialization.to_bytes(progress.state))
    log = {**header, "step": progress.step, "state_file": state_file, "next_microbatches": progress.split,
           "costs": [c.seconds_per_sample for c in progress.costs], "periods": progress.periods,
           "losses": losses, "makespan_s": sum(max(p["wall_s"]) for p in progress.periods)}
    _write_atomically(os.path.join(run_dir, SHARES_LOG), json.dumps(log, indent=1).encode())
    for name in os.listdir(run_dir):
        if name.startswith("ddp_state_") and name.endswith(".msgpack") and name != state_file:
            os.remove(os.path.join(run_dir, name))


def read_log(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, SHARES_LOG)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_progress(run_dir: str, template_state):
    """(Progress, losses so far) from the run directory's log and state."""
    # flax and shares (with jax) only in the workers: the launcher checks its arguments without jax
    from flax import serialization

    from nvfp4_jax.federated.budget import SiteCost
    from nvfp4_jax.federated.shares import Progress

    log = read_log(run_dir)
    with open(os.path.join(run_dir, log["state_file"]), "rb") as f:
        state = serialization.from_bytes(template_state, f.read())
    costs = [SiteCost(seconds_per_sample=c) for c in log["costs"]]
    return Progress(log["step"], state, list(log["next_microbatches"]), costs, log["periods"]), list(log["losses"])


# --- the worker: one process of the run ---------------------------------------------------------

def worker(args) -> Exit:
    # jax only in the workers: the launcher checks its arguments without jax
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.processes,
                               process_id=args.worker)
    from nvfp4_jax.federated.budget import BudgetPolicy
    from nvfp4_jax.federated.shares import train_shares
    from nvfp4_jax.train import assembly

    cfg, slowdown, microbatches = check(args)
    run = assembly.assemble(cfg, jax.local_devices()[:1])
    run_dir = run_directory(cfg)
    me = jax.process_index()
    resume, losses = (load_progress(run_dir, run.init_state()) if args.resume else (None, []))
    header = {"processes": args.processes, "microbatch": args.microbatch, "microbatches": microbatches,
              "policy": args.policy, "slowdown": slowdown, "slowdown_from": args.slowdown_from,
              "period": args.period}

    first = resume.step if resume else 0
    printed = [first]

    def on_period(progress, new_losses):
        if me == 0:
            save_progress(run_dir, progress, losses + [float(x) for x in new_losses], header)
            for step in range(printed[0], progress.step):
                print(f"[ddp] step={step + 1} loss={new_losses[step - first]:.6f}", flush=True)
            printed[0] = progress.step

    def log(line):
        if me == 0:
            print(f"[ddp] {line}", flush=True)

    policy = BudgetPolicy(name=args.policy, total_samples=microbatches, quantum=1)
    train_shares(
        run, microbatch=args.microbatch, initial=equal_split(microbatches, args.processes), steps=args.steps,
        period=args.period, slowdown=slowdown[me], slowdown_from=args.slowdown_from, policy=policy,
        resume=resume, on_period=on_period, log=log)
    if me == 0:
        final = read_log(run_dir)
        print(f"[ddp] {args.processes} processes x {args.steps} steps, policy={args.policy}: makespan_s="
              f"{final['makespan_s']:.3f}, final shares {final['next_microbatches']}; log in "
              f"{os.path.join(run_dir, SHARES_LOG)}", flush=True)
    jax.distributed.shutdown()
    return Exit.OK


# --- the launcher -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(args, argv: list[str]) -> Exit:
    cfg, _, _ = check(args)
    run_dir = run_directory(cfg)
    if args.resume:
        log = read_log(run_dir)
        if log is None:
            raise ConfigError(f"--resume: {os.path.join(run_dir, SHARES_LOG)} does not exist (no period was logged)")
        if log["processes"] != args.processes:
            raise ConfigError(f"--resume with --processes={args.processes}: the run was logged with {log['processes']}")
        if log["step"] >= args.steps:
            raise ConfigError(f"--steps={args.steps}: the run in {run_dir} is already at step {log['step']}")
    os.makedirs(run_dir, exist_ok=True)
    coordinator = f"localhost:{_free_port()}"
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    base = [sys.executable, "-m", "nvfp4_jax.federated.ddp", *argv, "--coordinator", coordinator]
    logs = [os.path.join(run_dir, f"ddp_process_{i}.log") for i in range(args.processes)]
    procs = []
    for i in range(args.processes):
        out = None if i == 0 else open(logs[i], "w")
        procs.append(subprocess.Popen(base + ["--worker", str(i)], env=env, stdout=out,
                                      stderr=subprocess.STDOUT if out else None))
    codes = [None] * len(procs)
    try:
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    try:
                        codes[i] = p.wait(timeout=0.5)
                    except subprocess.TimeoutExpired:
                        continue
                    if codes[i] != 0:  # one worker gone: the others would wait for it forever
                        for q in procs:
                            if q.poll() is None:
                                q.kill()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [i for i, c in enumerate(codes) if c != 0]
    if bad:
        i = bad[0]
        where = "its output above" if i == 0 else logs[i]
        return fail(f"worker {i} exited with status {codes[i]} (see {where}); the run can go on with --resume "
                    f"from its last logged period", Exit.INTERNAL)
    return Exit.OK


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    try:
        args = parse_command(_parser(), argv, __doc__)
        if args is None:
            return Exit.OK
        if args.worker >= 0:
            return worker(args)
        return launch(args, argv)
    except ConfigError as exc:
        return fail(exc, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
