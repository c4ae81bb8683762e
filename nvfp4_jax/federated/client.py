"""A site's FLARE client script (FLARE's Client API): receive the global model, train the round's
budget on local data with this project's trainer, send back the update the contract declares.

Run by FLARE (`ScriptRunner`), one per site, with the site's own arguments:
  --data-path PATH      this site's training text (`dataset_type=text`); empty: the config's data
  --devices K           local devices this site trains on (FSDP over them); 0: all
  --slowdown F          experiments: stretch compute time by F (a slower site), >= 1
  --watts W             energy model, joules = W x busy seconds, where no counter is readable
  --crash-in-round R    fault injection for tests: raise in round R
"""

from __future__ import annotations

import argparse
import sys


def _args(argv):
    p = argparse.ArgumentParser(prog="nvfp4_jax.federated.client")
    p.add_argument("--data-path", default="")
    p.add_argument("--devices", type=int, default=0)
    p.add_argument("--device-offset", type=int, default=0)
    p.add_argument("--slowdown", type=float, default=1.0)
    p.add_argument("--watts", type=float, default=None)
    p.add_argument("--crash-in-round", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    # optional dependency (NVFLARE); server imports it too
    import nvflare.client as flare
    from nvflare.app_common.abstract.fl_model import ParamsType

    from nvfp4_jax.federated.server import META_KEY

    args = _args(sys.argv[1:] if argv is None else argv)
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


def _train_round(args, site, spec, received, state):
    # jax and the trainer load in the site process only, once FLARE has started it
    import jax

    from nvfp4_jax.config import make_config
    from nvfp4_jax.federated import contract as contract_lib
    from nvfp4_jax.federated.site import SiteTrainer

    contract = contract_lib.UpdateContract(**spec["contract"])
    if args.crash_in_round and spec["round"] == args.crash_in_round:
        raise RuntimeError(f"injected crash in round {spec['round']}")
    if state["trainer"] is None:
        overrides = {"dataset_type": "text", "dataset_path": args.data_path} if args.data_path else {}
        cfg = make_config(spec["config"], overrides)
        devices = jax.devices()
        if args.devices:
            start = args.device_offset % len(devices)
            devices = (devices[start:] + devices[:start])[:args.devices]
        state["trainer"] = SiteTrainer(cfg, contract, devices=devices, slowdown=args.slowdown, watts=args.watts)
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
    return payload, report, contract


if __name__ == "__main__":
    main()
