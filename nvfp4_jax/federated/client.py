"""A site's FLARE client script (FLARE's Client API): receive the global model, train the round's
budget on local data with this project's trainer, send back the update the contract declares.

Run by FLARE (`ScriptRunner`), one per site, with the site's own arguments:
  --data-path PATH      this site's training text (`dataset_type=text`; a VLM's: an image_text
                        JSONL, `dataset_type=image_text`), as the simulator and POC
                        mode pass it; empty (an exported job): the site's own setting (below)
  --devices K           local devices this site trains on (FSDP over them); 0: all
  --slowdown F          experiments: stretch compute time by F (a slower site), >= 1
  --silo-shares P       off | equal | static | adaptive: FSDP over the site's devices, or each
                        device its own share of the step (federated/silo.py), with
                        --silo-microbatch M rows a microbatch, --silo-ema, --silo-deadband
  --device-slowdown F1,F2,...   experiments: stretch each device's compute (silo shares)
  --watts W             energy model, joules = W x busy seconds, where no counter is readable
  --crash-in-round R    fault injection for tests: raise in round R

A site of an exported job reads its data path from a site-local setting (`site_data_path`), not
from the job: the environment variable NVFP4_JAX_SITE_DATA of the site's FLARE processes, else
`data_path` in `local/nvfp4_jax_site.json` of the site's FLARE workspace (a relative path there is
relative to the workspace); with neither, the run config's own data (the bundled corpus by default).
"""

from __future__ import annotations

import json
import os
import sys

from nvfp4_jax.cli import CommandParser, Exit, parse_command

SITE_DATA_ENV = "NVFP4_JAX_SITE_DATA"
SITE_SETTINGS = os.path.join("local", "nvfp4_jax_site.json")  # in the site's FLARE workspace


def site_data_path(given: str, environ=None, workspace: str = "") -> tuple[str, str]:
    """(the site's training text, where that came from): the job's own `--data-path` (the
    simulator, POC mode), else NVFP4_JAX_SITE_DATA, else `data_path` in the workspace's
    `local/nvfp4_jax_site.json`, else ("", "config"): the run config's own data. FLARE runs a
    site's processes in its workspace, the default `workspace`. A path that is not a file raises
    ValueError naming the setting it came from."""
    environ = os.environ if environ is None else environ
    workspace = workspace or os.getcwd()
    settings = os.path.join(workspace, SITE_SETTINGS)
    if given:
        path, source = given, "--data-path"
    elif environ.get(SITE_DATA_ENV):
        path, source = environ[SITE_DATA_ENV], SITE_DATA_ENV
    elif os.path.isfile(settings):
        with open(settings) as f:
            path, source = str(json.load(f).get("data_path") or ""), settings
        if not path:
            raise ValueError(f"{settings} names no data_path (e.g. {{\"data_path\": \"/data/site.txt\"}})")
        path = os.path.join(workspace, path)  # an absolute path stays as it is
    else:
        return "", "config"
    if not os.path.isfile(path):
        raise ValueError(f"the site's data path {path!r} (from {source}) is not a file")
    return path, source


def site_data_overrides(run_config: dict, data_path: str) -> dict:
    """The config keys that make a site train on its own `data_path` (empty: none): a text
    file for the Llama, an `image_text` JSONL (examples.jsonl beside its images) for a VLM."""
    if not data_path:
        return {}
    kind = "image_text" if run_config.get("model_type") == "vlm" else "text"
    return {"dataset_type": kind, "dataset_path": data_path}


def _parser() -> CommandParser:
    p = CommandParser("federated.client", hint=False)
    p.add_argument("--data-path", default="")
    p.add_argument("--devices", type=int, default=0)
    p.add_argument("--device-offset", type=int, default=0)
    p.add_argument("--slowdown", type=float, default=1.0)
    p.add_argument("--watts", type=float, default=None)
    p.add_argument("--silo-shares", default="off")
    p.add_argument("--silo-microbatch", type=int, default=1)
    p.add_argument("--silo-ema", type=float, default=0.5)
    p.add_argument("--silo-deadband", type=float, default=0.05)
    p.add_argument("--device-slowdown", default="")
    p.add_argument("--crash-in-round", type=int, default=0)
    return p


def main(argv=None) -> Exit:
    """The site's rounds until FLARE stops it. A bad argument raises ValueError (one line): FLARE
    runs this script in its own process or thread, where raising, not exiting, ends the job."""
    args = parse_command(_parser(), sys.argv[1:] if argv is None else argv, __doc__, help_when_empty=False)
    if args is None:
        return Exit.OK
    # optional dependency (NVFLARE); server imports it too
    import nvflare.client as flare
    from nvflare.app_common.abstract.fl_model import ParamsType

    from nvfp4_jax.federated.server import META_KEY

    flare.init()
    site = flare.get_site_name()
    state = {"trainer": None, "residual": None}
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        spec = received.meta[META_KEY]
        try:
            payload, report, contract = _train_round(args, site, spec, received, state)
        except Exception as exc:  # a failed round: reported, left out of the average; the job goes on
            print(f"error: {site}: round {spec.get('round')} failed: {exc}", file=sys.stderr, flush=True)
            flare.send(flare.FLModel(params={}, meta={"NUM_STEPS_CURRENT_ROUND": 0,
                                                      META_KEY: {"error": f"{type(exc).__name__}: {exc}"}}))
            continue
        flare.send(flare.FLModel(
            params=payload,
            params_type=ParamsType.DIFF if contract.sends_difference else ParamsType.FULL,
            meta={"NUM_STEPS_CURRENT_ROUND": report["samples"], META_KEY: report},
        ))
    return Exit.OK


def _train_round(args, site, spec, received, state):
    # jax and the trainer load in the site process only, once FLARE has started it
    import jax

    from nvfp4_jax.config import make_config
    from nvfp4_jax.federated import contract as contract_lib
    from nvfp4_jax.federated.budget import SiloPolicy
    from nvfp4_jax.federated.site import SiteTrainer

    contract = contract_lib.UpdateContract(**spec["contract"])
    if args.crash_in_round and spec["round"] == args.crash_in_round:
        raise RuntimeError(f"injected crash in round {spec['round']}")
    if state["trainer"] is None:
        data_path, source = site_data_path(args.data_path)
        shown = data_path or "the run config's own data"
        print(f"{site}: training on {shown} (from {source})", flush=True)
        cfg = make_config(spec["config"], site_data_overrides(spec["config"], data_path))
        devices = jax.devices()
        if args.devices:
            start = args.device_offset % len(devices)
            devices = (devices[start:] + devices[:start])[:args.devices]
        silo = SiloPolicy(args.silo_shares, args.silo_microbatch, args.silo_ema, args.silo_deadband)
        device_slowdown = tuple(float(f) for f in args.device_slowdown.split(",")) if args.device_slowdown else None
        state["trainer"] = SiteTrainer(cfg, contract, devices=devices, slowdown=args.slowdown, watts=args.watts,
                                       silo=silo, device_slowdown=device_slowdown)
    window = spec.get("schedule_window")
    result = state["trainer"].train_round(received.params, int(spec["budgets"][site]),
                                          schedule_window=None if window is None else tuple(window))
    if contract.sends_difference:
        update = {k: v - received.params[k] for k, v in result.params.items()}
    else:
        update = result.params
    if not contract_lib.all_finite(update):
        # Folding it into the error-feedback residual would poison every later round: reset it,
        # and send nothing (the server leaves this site out of the round).
        state["residual"] = None
        raise RuntimeError(f"round {spec['round']}: the update is not finite (NaN or Inf); "
                           "it is not sent and the error-feedback residual is reset")
    payload, shapes, state["residual"] = contract_lib.encode(update, contract.compression, state["residual"])
    report = {
        "samples": result.samples, "steps": result.steps, "seconds": result.seconds,
        "joules": result.joules, "energy_source": result.energy_source, "train_loss": result.train_loss, "shapes": shapes,
        "payload_bytes": contract_lib.payload_bytes(payload),
        "data_tokens": getattr(state["trainer"], "data_tokens", None),
    }
    if getattr(state["trainer"], "silo_record", None) is not None:
        report["silo"] = state["trainer"].silo_record
    return payload, report, contract


if __name__ == "__main__":
    main()
