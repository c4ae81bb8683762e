"""`python -m nvfp4_jax.federated [config.yml] [key=value ...] --sites N --rounds R [options]`

Federated training of this project's Llama on NVIDIA FLARE: FedAvg on the server (weighted by
each site's training data, or `--weighting samples`), this project's trainer on every site (any `quantization`, any local
mesh), per-site sample budgets. Runs the job in FLARE's simulator on this machine, or with
`--export DIR` writes the FLARE job folder for real sites instead (docs/federated.md).

Options:
  --sites N                 number of sites (default 3)
  --rounds R                FedAvg rounds (default 3)
  --budget P                equal | static | adaptive (default adaptive): how a round's samples
                            are split between sites
  --samples-per-round S     the round's total samples over all sites (default: 4 steps of the
                            global batch per site)
  --w-time W, --w-energy W  weights of per-sample time and energy in a site's cost (1, 0)
  --ema A, --deadband D     smoothing of the measured costs (0.5) and the deadband (0.05)
  --update K                full | diff | subset | adapters (default diff): what a site sends;
                            adapters: the LoRA adapters alone (lora_rank > 0), the backbone frozen
  --trainable T             with --update subset: mlp | projector (a VLM's) | last:N | a regex over
                            parameter paths; with --update adapters: leaves trained beside them
  --compression C           none | fp8 | nvfp4 (default none), with error feedback on the site
  --privacy F               none | percentile | svt | gaussian (FLARE result filters on every site)
  --percentile P, --gamma G options of --privacy percentile: share only the update values above
                            the P-th percentile of magnitudes (0 <= P < 100, default 10), each
                            clipped to +-G (G > 0, default 0.01)
  --svt-fraction F, --svt-epsilon E, --svt-noise-var V, --svt-gamma G
                            options of --privacy svt: release a fraction 0 < F <= 1 of the values
                            (0.1), selection budget E > 0 (0.1), release budget V > 0 a value
                            (0.1), clip G > 0 (1e-5)
  --clip-norm X, --noise-multiplier X   options of --privacy gaussian: L2 clip X > 0 (1.0), noise
                            multiplier > 0 (required)
  --site-privacy SITE=FILTER[:key=value,...]   (repeatable) one site's own filter instead of
                            --privacy's, e.g. site-2=gaussian:noise_multiplier=2.0,clip_norm=0.5;
                            keys are the options' names (percentile, gamma, fraction, epsilon,
                            noise_var, clip_norm, noise_multiplier)
  --dp-delta D              delta of the epsilon the accountant reports (0 < D < 1, default 1e-5):
                            each round line shows every site's cumulative eps (gaussian: RDP
                            accountant; svt: FLARE's per-round epsilon, summed)
  --dirichlet-alpha A       split the bundled corpus by play between the sites, Dirichlet(A) per
                            genre (default 1.0; used when the data is the bundled corpus); a VLM
                            on the digits: their training images by class, and each site's task
                            mix, Dirichlet(A) each (federated/image_split.py)
  --site-data PATH          one per site (repeat N times): each site's own text file (a VLM's:
                            an image_text JSONL)
  --backbone RUN_DIR        the initial global model: the newest checkpoint of a central
                            `python -m nvfp4_jax.train` run of the same model and held-out split
                            (under --update adapters|subset the backbone then never travels)
  --slowdown F1,F2,...      per-site compute slowdown factors (experiments), >= 1
  --watts W1,W2,...         per-site power for the stated energy model (joules = W x seconds)
  --site-devices K[,K2,...]  local devices per site (default 1; FSDP over them), one count for
                            every site or one per site (silos of unequal size: each site's
                            budget is a multiple of its own global batch, and the counts must be
                            multiples of the smallest)
  --silo-shares P           off | equal | static | adaptive (default off): inside a site of
                            several devices, off trains FSDP over them; a policy gives each
                            device its own share of the site's step batch (microbatches of
                            --silo-microbatch rows, default 1), re-split every round by the
                            budget controller (--ema, --deadband) from each device's measured
                            time (federated/silo.py)
  --device-slowdown SITE=F1,F2,...   (repeatable) experiments: stretch each device of SITE by
                            its factor (>= 1, one per device); needs --silo-shares
  --weighting W             data | samples (default data): FedAvg weights each site's update by
                            its training tokens (FedAvg's definition), or by the samples it
                            trained in the round (leans toward the sites given more)
  --min-responses M         a round completes with M results (default: all sites)
  --round-timeout S         seconds a round waits for results (default 0: forever)
  --disk-offload            the server keeps each round's running sum of the updates in files
                            on disk, not in memory (docs/federated.md, "Big models")
  --stream-tensors          FLARE tensor streaming for the model exchange (big models); needs
                            torch, which the federated extra does not install (pip install torch)
  --env E                   sim | poc (default sim): run the job in FLARE's simulator, or in
                            FLARE's POC mode (a server and one client process per site on
                            loopback, through the admin API; docs/federated.md)
  --export DIR              write the FLARE job folder to DIR instead of running it
  --debug                   tracebacks with errors

Exit codes: 0 done, 2 a bad setting (one `error: ...` line), 3 every site failed in a round (the
job ended; one `error:` line names the last good global model), 1 an internal error.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys

from nvfp4_jax.cli import CommandParser, Exit, debug_requested, fail

ENVS = ("sim", "poc")  # where the job runs: FLARE's simulator, or its POC mode
from nvfp4_jax.config import ConfigError, config_layers, global_batch_size, make_config

DEFAULTS = {
    "model_name": "tiny", "quantization": "te_nvfp4", "max_target_length": 128,
    "per_device_batch_size": 4, "eval_steps": 2, "run_name": "federated",
}


# The command-line flag of every filter option (privacy.OPTIONS), for the job-wide --privacy.
FILTER_FLAGS = {
    "percentile": {"percentile": "--percentile", "gamma": "--gamma"},
    "svt": {"fraction": "--svt-fraction", "epsilon": "--svt-epsilon", "noise_var": "--svt-noise-var",
            "gamma": "--svt-gamma"},
    "gaussian": {"clip_norm": "--clip-norm", "noise_multiplier": "--noise-multiplier"},
}


def _parser() -> CommandParser:
    p = CommandParser("federated", error=ConfigError, hint=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", default="adaptive")
    p.add_argument("--samples-per-round", type=int, default=0)
    p.add_argument("--w-time", type=float, default=1.0)
    p.add_argument("--w-energy", type=float, default=0.0)
    p.add_argument("--ema", type=float, default=0.5)
    p.add_argument("--deadband", type=float, default=0.05)
    p.add_argument("--update", default="diff")
    p.add_argument("--trainable", default="all")
    p.add_argument("--compression", default="none")
    p.add_argument("--privacy", default="none")
    for flags in FILTER_FLAGS.values():
        for flag in flags.values():
            p.add_argument(flag, type=float, default=None)
    p.add_argument("--site-privacy", action="append", default=[])
    p.add_argument("--dp-delta", type=float, default=1e-5)
    p.add_argument("--dirichlet-alpha", type=float, default=1.0)
    p.add_argument("--site-data", action="append", default=[])
    p.add_argument("--backbone", default="")
    p.add_argument("--slowdown", default="")
    p.add_argument("--watts", default="")
    p.add_argument("--site-devices", default="1")
    p.add_argument("--silo-shares", default="off")
    p.add_argument("--silo-microbatch", type=int, default=1)
    p.add_argument("--device-slowdown", action="append", default=[])
    p.add_argument("--min-responses", type=int, default=0)
    p.add_argument("--weighting", default="data")
    p.add_argument("--env", default="sim")
    p.add_argument("--round-timeout", type=int, default=0)
    p.add_argument("--disk-offload", action="store_true")
    p.add_argument("--stream-tensors", action="store_true")
    p.add_argument("--export", default="")
    p.add_argument("--workspace", default="")
    p.add_argument("--crash-site-in-round", default="", help=argparse.SUPPRESS)  # tests: "site-2:1"
    return p


@dataclasses.dataclass(frozen=True)
class SiteFiles:
    """What `main` writes before the job starts (None: nothing of that kind)."""

    corpus: tuple | None = None  # (directory, alpha, seed, eval_fraction): the text corpus's split
    images: tuple | None = None  # the same for the digits' training images (image_split.py)
    backbone: tuple | None = None  # (RUN_DIR, its Config, the parameters checkpoint to write)


def _site_devices(text: str, n: int) -> list[int]:
    """--site-devices: one count for every site, or one per site; each >= 1."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--site-devices={text!r} must be a whole number, or {n} comma-separated ones (one per site)") from None
    if len(counts) == 1:
        counts = counts * n
    if len(counts) != n:
        raise ConfigError(f"--site-devices={text!r} gives {len(counts)} counts for {n} sites")
    if any(k < 1 for k in counts):
        raise ConfigError(f"--site-devices={text!r}: every count must be at least 1")
    return counts


def _silo(args, cfg, site_devices: list[int]) -> tuple:
    """(the silo policy, {site: per-device slowdowns}) of --silo-shares and --device-slowdown."""
    # budget is pure Python, imported after --help as build_spec's own imports
    from nvfp4_jax.federated import budget as budget_lib

    if args.silo_shares == "off":
        if args.device_slowdown:
            raise ConfigError("--device-slowdown stretches per-device shares: give --silo-shares equal|static|adaptive")
        return budget_lib.SiloPolicy(), {}
    policy = budget_lib.SiloPolicy(name=args.silo_shares, microbatch=args.silo_microbatch, ema=args.ema,
                                 deadband=args.deadband)
    if max(site_devices) < 2:
        raise ConfigError(f"--silo-shares={args.silo_shares} splits a site's step between its devices: give some "
                          "site several (--site-devices 2, or 1,2,4)")
    try:
        for k in site_devices:
            budget_lib.check_silo(policy, k, global_batch_size(cfg.train.per_device_batch_size, k))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    names = [f"site-{i}" for i in range(1, len(site_devices) + 1)]
    slowdowns = {}
    for text in args.device_slowdown:
        site, _, factors = text.partition("=")
        if site not in names:
            raise ConfigError(f"--device-slowdown {text!r}: {site!r} is not a site (one of {', '.join(names)})")
        k = site_devices[names.index(site)]
        if k == 1:
            raise ConfigError(f"--device-slowdown {text!r}: {site} has one device; slow it with --slowdown")
        try:
            values = tuple(float(f) for f in factors.split(","))
        except ValueError:
            values = ()
        if len(values) != k or not all(f >= 1.0 for f in values):
            raise ConfigError(f"--device-slowdown {text!r}: {site} has {k} devices; give {k} comma-separated "
                              "factors >= 1")
        if site in slowdowns:
            raise ConfigError(f"--device-slowdown names {site} twice")
        slowdowns[site] = values
    return policy, slowdowns


def _floats(text: str, n: int, name: str, default: float | None) -> list:
    if not text:
        return [default] * n
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"--{name}={text!r} must be {n} comma-separated numbers, one per site") from None
    if len(values) != n:
        raise ConfigError(f"--{name}={text!r} gives {len(values)} values for {n} sites")
    return values


def _check_filterable(where: str, name: str, contract) -> None:
    if name != "none" and (not contract.sends_difference or contract.compression != "none"):
        raise ConfigError(f"{where} filters uncompressed differences: use --update diff "
                          "(or subset, adapters) with --compression none")


def _privacy_policies(args, site_names: list, contract) -> tuple[dict, dict]:
    """(the job-wide filter's options, {site: {"filter": name, **options}} for --site-privacy)."""
    # privacy imports NVFLARE (optional), as build_spec does
    from nvfp4_jax.federated import privacy as privacy_lib

    if not (0 < args.dp_delta < 1):
        raise ConfigError(f"--dp-delta={args.dp_delta} must be in (0, 1), exclusive (e.g. 1e-5)")
    _check_filterable(f"--privacy={args.privacy}", args.privacy, contract)
    given = {}
    for name, flags in FILTER_FLAGS.items():
        for key, flag in flags.items():
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is None:
                continue
            if name != args.privacy:
                raise ConfigError(f"{flag} is an option of --privacy {name}, not of --privacy {args.privacy} "
                                  "(a site's own filter takes key=value in --site-privacy)")
            given[key] = value
    site_privacy = {}
    try:
        options = privacy_lib.resolve_options(args.privacy, given, FILTER_FLAGS.get(args.privacy, {}).get)
        for text in args.site_privacy:
            site, name, site_given = privacy_lib.parse_site_privacy(text, site_names)
            _check_filterable(f"--site-privacy {text!r}", name, contract)
            if site in site_privacy:
                raise ConfigError(f"--site-privacy names {site} twice")
            site_privacy[site] = {"filter": name, **privacy_lib.resolve_options(
                name, site_given, lambda key: f"--site-privacy {site}={name}:{key}")}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return options, site_privacy


def build_spec(argv: list[str]):
    """(FederatedSpec, options) from the command line; ConfigError for anything wrong."""
    # after --help: privacy imports NVFLARE (optional)
    from nvfp4_jax.federated import budget as budget_lib
    from nvfp4_jax.federated import contract as contract_lib
    from nvfp4_jax.federated import privacy as privacy_lib
    from nvfp4_jax.federated.job import FederatedSpec, SiteSpec

    args, rest = _parser().parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r} (see --help)")
    if args.sites < 1:
        raise ConfigError(f"--sites={args.sites} must be at least 1")
    if args.rounds < 1:
        raise ConfigError(f"--rounds={args.rounds} must be at least 1")
    if not 0 <= args.min_responses <= args.sites:
        raise ConfigError(f"--min-responses={args.min_responses} must be between 0 (all) and --sites={args.sites}")
    if args.round_timeout < 0:
        raise ConfigError(f"--round-timeout={args.round_timeout} must be >= 0")
    if args.privacy not in privacy_lib.PRIVACY:
        raise ConfigError(f"--privacy={args.privacy!r} is not one of {', '.join(privacy_lib.PRIVACY)}")
    layers = [DEFAULTS, *config_layers(rest)]
    merged = {k: v for layer in layers for k, v in layer.items()}
    cfg = make_config(*layers)  # validates every training key
    n = args.sites
    site_devices = _site_devices(args.site_devices, n)
    quanta = [global_batch_size(cfg.train.per_device_batch_size, k) for k in site_devices]
    global_batch = min(quanta)  # the nominal site's: the schedule counts its steps
    total = args.samples_per_round or 4 * global_batch * n
    if "steps" not in layers[-1]:  # the schedule spans the sites' expected local steps (a recipe's
        # `steps` is central training's; `steps=` on the command line is kept)
        merged["steps"] = max(1, args.rounds * total // (n * global_batch))
    policy = budget_lib.BudgetPolicy(
        name=args.budget, total_samples=total, quantum=global_batch,
        site_quanta=tuple(quanta) if len(set(quanta)) > 1 else (), w_time=args.w_time,
        w_energy=args.w_energy, ema=args.ema, deadband=args.deadband)
    contract = contract_lib.UpdateContract(kind=args.update, trainable=args.trainable,
                                           compression=args.compression)
    try:
        budget_lib.check_policy(policy, n)
        contract_lib.check_contract(contract)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if contract.kind == "adapters" and not cfg.model.lora_rank:
        raise ConfigError("--update adapters sends the LoRA adapters: give the model some (lora_rank=8, say)")
    if contract.kind == "adapters" and cfg.train.train_params == "all":
        raise ConfigError("--update adapters trains the adapters alone: drop train_params=all")
    if contract.kind == "adapters" and contract.trainable != "all":
        merged["train_params"] = "all"  # the adapters and --trainable's leaves (the site freezes the rest)
    if args.stream_tensors and importlib.util.find_spec("torch") is None:
        raise ConfigError("--stream-tensors needs torch (FLARE's tensor streamers import it), which "
                          "nvfp4_jax[federated] does not install: pip install torch")
    if args.env not in ENVS:
        raise ConfigError(f"--env={args.env!r} is not allowed: one of {', '.join(ENVS)}")
    if args.weighting not in contract_lib.WEIGHTINGS:
        raise ConfigError(f"--weighting={args.weighting!r} is not allowed: one of {', '.join(contract_lib.WEIGHTINGS)}")
    slowdowns = _floats(args.slowdown, n, "slowdown", 1.0)
    if any(not s >= 1.0 for s in slowdowns):
        raise ConfigError(f"--slowdown={args.slowdown!r}: every factor must be >= 1")
    watts = _floats(args.watts, n, "watts", None)
    if any(w is not None and not w > 0 for w in watts):
        raise ConfigError(f"--watts={args.watts!r}: every power must be > 0")
    if args.site_data and len(args.site_data) != n:
        raise ConfigError(f"--site-data was given {len(args.site_data)} times for --sites={n}: give one path per site")
    for path in args.site_data:
        if not os.path.isfile(path):
            raise ConfigError(f"--site-data {path!r} is not a file")
    crash = {}
    if args.crash_site_in_round:
        site, _, rnd = args.crash_site_in_round.partition(":")
        crash[site] = int(rnd)
    silo, device_slowdowns = _silo(args, cfg, site_devices)
    run_dir = os.path.abspath(os.path.join(cfg.train.base_output_directory, cfg.train.run_name))
    files = _site_files(args, cfg, merged, run_dir)
    data_paths = list(args.site_data)
    if files.corpus is not None:
        data_paths = [os.path.join(files.corpus[0], f"site-{i}.txt") for i in range(1, n + 1)]
    elif files.images is not None:
        # image_split loads the data package: only for a VLM's split
        from nvfp4_jax.federated.image_split import EXAMPLES_FILE

        data_paths = [os.path.join(files.images[0], f"site-{i}", EXAMPLES_FILE) for i in range(1, n + 1)]
    elif not data_paths:
        data_paths = [""] * n
    sites = tuple(
        SiteSpec(name=f"site-{i}", data_path=data_paths[i - 1], slowdown=slowdowns[i - 1], watts=watts[i - 1],
                 devices=site_devices[i - 1], device_offset=sum(site_devices[:i - 1]),
                 device_slowdown=device_slowdowns.get(f"site-{i}", ()),
                 crash_in_round=crash.get(f"site-{i}", 0))
        for i in range(1, n + 1))
    privacy_options, site_privacy = _privacy_policies(args, [s.name for s in sites], contract)
    spec = FederatedSpec(
        run_config={k: v for k, v in merged.items()}, sites=sites, rounds=args.rounds, policy=policy,
        contract=contract, privacy=args.privacy, privacy_options=privacy_options, site_privacy=site_privacy,
        dp_delta=args.dp_delta,
        output_dir=run_dir, min_responses=args.min_responses, round_timeout=args.round_timeout,
        disk_offload=args.disk_offload, stream_tensors=args.stream_tensors, weighting=args.weighting,
        eval_batches=cfg.train.eval_steps, silo=silo)
    return spec, args, files


def _site_files(args, cfg, merged: dict, run_dir: str) -> SiteFiles:
    """What the job's sites and server need written first: the split data (the bundled corpus,
    or a VLM's digits, when no --site-data is given) and the --backbone's parameters (its path
    set as `load_parameters_path` in `merged`, the run config)."""
    backbone = None
    if args.backbone:
        if cfg.train.load_parameters_path:
            raise ConfigError("--backbone sets load_parameters_path: give one of them")
        # backbone imports train's parameters-checkpoint format (jax): only with --backbone
        from nvfp4_jax.federated.backbone import check_backbone

        saved = check_backbone(args.backbone, cfg)
        merged["load_parameters_path"] = os.path.join(run_dir, "backbone")
        backbone = (args.backbone, saved, merged["load_parameters_path"])
    split_here = cfg.model.model_type == "vlm" or cfg.data.dataset_type == "shakespeare"
    if args.site_data or not split_here:
        return SiteFiles(backbone=backbone)
    if not (args.dirichlet_alpha > 0):
        raise ConfigError(f"--dirichlet-alpha={args.dirichlet_alpha} must be > 0")
    # The sites hold only the data before (text) or outside (images) the split the server evaluates on.
    split = (os.path.join(run_dir, "site_data"), args.dirichlet_alpha, cfg.train.seed, cfg.data.eval_fraction)
    if cfg.model.model_type == "vlm":
        if cfg.data.dataset_type != "digits":
            raise ConfigError(f"a federated VLM splits the digits (dataset_type=digits) between the sites; with "
                              f"dataset_type={cfg.data.dataset_type} give each site its own --site-data (image_text JSONL)")
        return SiteFiles(images=split, backbone=backbone)
    return SiteFiles(corpus=split, backbone=backbone)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return Exit.OK
    if importlib.util.find_spec("nvflare") is None:  # before build_spec: the privacy filters import it
        return fail("federated training needs NVIDIA FLARE: pip install 'nvfp4_jax[federated]'")
    try:
        spec, args, files = build_spec(argv)
        _write_site_files(files, len(spec.sites))
    except ConfigError as exc:
        return fail(exc, debug=debug)
    # job needs NVFLARE (optional), checked just above
    from nvfp4_jax.federated import job as job_lib

    if args.export:
        where = job_lib.export(spec, os.path.abspath(args.export))
        print(f"[federated] FLARE job folder written to {where} (see docs/federated.md to run it on real sites)")
        if files.backbone is not None:
            print(f"[federated] backbone written to {os.path.join(os.path.dirname(where), job_lib.EXPORTED_BACKBONE)}: "
                  f"copy it into the server's and every site's workspace", flush=True)
        return Exit.OK
    p = spec.policy
    print(f"[federated] {len(spec.sites)} sites x {spec.rounds} rounds, budget={p.name} "
          f"({p.total_samples} samples a round), update={spec.contract.kind}, "
          f"compression={spec.contract.compression}, privacy={spec.privacy}"
          + "".join(f", {site}: privacy={p['filter']}" for site, p in spec.site_privacy.items())
          + f"; results in {spec.output_dir}",
          flush=True)
    workspace = args.workspace or os.path.join(spec.output_dir, "flare_workspace")
    if args.env == "poc":
        # poc needs NVFLARE (optional), checked above
        from nvfp4_jax.federated import poc
        from nvfp4_jax.federated.server import round_line

        try:
            poc.run(job_lib.build_job(spec), [s.name for s in spec.sites], os.path.join(workspace, "poc"),
                    spec.output_dir, rounds=spec.rounds)
        except poc.PocError as exc:
            return fail(exc, Exit.INTERNAL)
        for record in _rounds(spec.output_dir):  # the server's lines went to its own log
            print(f"[federated] {round_line(record, spec.rounds)}", flush=True)
    else:
        job_lib.simulate(spec, workspace)
    ended = _ended(spec.output_dir)
    if ended:
        return fail(ended, Exit.SITES_FAILED)
    done = len(_rounds(spec.output_dir)) - 1  # the first record is the initial model's
    if done < spec.rounds:
        # FLARE's simulator returns normally when it aborts a job (a fatal system error at the
        # server or a site): without this check the job would pass for finished.
        return fail(f"FLARE stopped the job after round {max(done, 0)} of {spec.rounds}"
                    + "".join(f": {line}" for line in _fatal_lines(workspace)[:1])
                    + f" (FLARE's logs: {workspace})", Exit.INTERNAL)
    return Exit.OK


def _write_site_files(files: SiteFiles, num_sites: int) -> None:
    """Writes `files` (the split data, the backbone), printing what each site holds."""
    # split and image_split import the data package: only once the job is checked
    from nvfp4_jax.federated.image_split import write_site_images
    from nvfp4_jax.federated.split import write_site_corpora

    try:
        if files.corpus is not None:
            for h in write_site_corpora(files.corpus[0], num_sites, *files.corpus[1:]):
                genres = ", ".join(f"{g} {c}" for g, c in sorted(h["genres"].items()))
                print(f"[federated] {h['site']}: {h['plays']} plays ({genres}), {h['bytes']} bytes", flush=True)
        if files.images is not None:
            for h in write_site_images(files.images[0], num_sites, *files.images[1:]):
                classes = " ".join(f"{c}:{k}" for c, k in h["classes"].items())
                tasks = ", ".join(f"{t} {k}" for t, k in h["tasks"].items())
                print(f"[federated] {h['site']}: {h['images']} training images (digits {classes}), "
                      f"{h['examples']} examples ({tasks})", flush=True)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if files.backbone is not None:
        # reads the backbone's checkpoint (jax, the trainer): only with --backbone
        from nvfp4_jax.federated.backbone import write_backbone

        run_dir, saved, out_dir = files.backbone
        step = write_backbone(run_dir, saved, out_dir)
        print(f"[federated] backbone: step {step} of {os.path.abspath(run_dir)} (pretrained centrally), "
              f"the initial global model", flush=True)


def _rounds(output_dir: str) -> list[dict]:
    """The rounds the server recorded in `output_dir`/federated.json (none when it wrote none)."""
    try:
        with open(os.path.join(output_dir, "federated.json")) as f:
            return list(json.load(f)["rounds"])
    except (OSError, ValueError, KeyError):
        return []


def _fatal_lines(workspace: str) -> list[str]:
    """The error lines FLARE's server and sites logged (`error_log.txt`), the server's first,
    each without its logger prefix."""
    lines = []
    for name in sorted(os.listdir(workspace) if os.path.isdir(workspace) else [], key=lambda n: n != "server"):
        try:
            with open(os.path.join(workspace, name, "error_log.txt"), errors="replace") as f:
                lines += [line.rstrip().rsplit("] - ", 1)[-1] for line in f if " - ERROR - " in line]
        except OSError:
            continue
    return lines


def _ended(output_dir: str) -> str | None:
    """The server's line when every site failed in a round and the job ended early, else None."""
    return next((r["ended"] for r in _rounds(output_dir) if r.get("ended")), None)


if __name__ == "__main__":
    sys.exit(main())
