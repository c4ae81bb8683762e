"""A federated VLM: adapter-only FedAvg vs full-model FedAvg vs centralized training, held-out VQA.

Per seed: a backbone (`recipes/configs/vlm-tiny.yml`, NVFP4) is pretrained centrally on a
*public* split, the caption examples of 30% of the digits' training images (it learns to name a
digit, not to answer the questions). The other 70% of the training images are the sites' private
data, dealt out by `federated/image_split.py` (Dirichlet(alpha) over classes and over the task
mix), and every method starts from that backbone and trains the same number of samples:

- `adapters`: FedAvg of rank-8 LoRA adapters on the decoder, the backbone frozen at every site
  (what `--update adapters lora_rank=8 --backbone RUN` runs on FLARE);
- `full`: FedAvg of the whole model;
- `central`: the adapters trained on the union of the private data in one place (the reference
  FedAvg is measured against), once per seed.

The rounds run in this process with the job's own pieces, not through FLARE (whose dispatch adds
seconds a round and nothing to accuracy): each site is `federated.site.SiteTrainer` (the job's
site trainer: its optimizer state and data position kept between rounds, the learning-rate
schedule read through the server's round window), averaged as FLARE's FedAvg does (weighted by the
sites' data tokens, the job's default `--weighting tokens`) and scored by `federated.site.Evaluator`
(the server's held-out VQA, every question of the 20% held-out images). Traffic is a site's upload
per round: the trained leaves' float32 bytes, against the full model's.

    .venv/bin/python benchmarks/bench_vlm_federated.py [--seeds 3] [--sites 4,8,16] [--alphas 0.3,10]
        [--rounds 4] [--samples-per-round 1024] [--quick] [--out PATH]

`--quick`: 1 seed, 4 sites, alpha 0.3 (a few minutes). Writes benchmarks/results/vlm_federated.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import environment, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nvfp4_jax.config import config_layers, make_config  # noqa: E402
from nvfp4_jax.data import digits  # noqa: E402
from nvfp4_jax.data.image_batches import split_images  # noqa: E402
from nvfp4_jax.federated import image_split  # noqa: E402
from nvfp4_jax.federated.contract import UpdateContract, payload_bytes  # noqa: E402
from nvfp4_jax.federated.site import Evaluator, SiteTrainer  # noqa: E402

RECIPE = str(ROOT / "recipes" / "configs" / "vlm-tiny.yml")
BATCH = 8  # per_device_batch_size of every site and of central training (one device each)
PUBLIC_FRACTION = 0.3
LORA_RANK = 8


def _config(seed: int, **keys):
    layers = config_layers([RECIPE, f"seed={seed}", f"per_device_batch_size={BATCH}", "eval_steps=2",
                            *(f"{k}={v}" for k, v in keys.items())])
    return make_config(*layers)


def _splits(seed: int, workdir: str):
    """(public JSONL, the private training image ids, the private pool's JSONL)."""
    images, labels = digits.load_images()
    train_ids = split_images(images, 0.2, seed)["train"]  # the job's split: the server's held-out rest
    rng = np.random.default_rng([seed, 7])
    order = rng.permutation(train_ids)
    public_ids, private_ids = np.sort(order[:int(PUBLIC_FRACTION * len(order))]), np.sort(order[int(PUBLIC_FRACTION * len(order)):])
    public = [e for i in public_ids for e in digits.examples_of(int(i), int(labels[i])) if e.kind == "caption"]
    pool = [e for i in private_ids for e in digits.examples_of(int(i), int(labels[i]))]
    return (image_split.write_examples(os.path.join(workdir, "public"), images, public), private_ids,
            image_split.write_examples(os.path.join(workdir, "pool"), images, pool))


def _site_files(seed: int, private_ids, num_sites: int, alpha: float, workdir: str) -> list[str]:
    images, labels = digits.load_images()
    sites = image_split.split_examples(labels, private_ids, num_sites, alpha, seed)
    return [image_split.write_examples(os.path.join(workdir, f"sites{num_sites}_a{alpha}", f"site-{i}"), images, ex)
            for i, ex in enumerate(sites, 1)]


class _Sites:
    """Every site's state in one compiled SiteTrainer: the sites share the model's shapes, so
    the step is compiled once, and each site keeps its own parameters' optimizer state, data
    and data position (what its own process would hold)."""

    def __init__(self, seed, contract, files, **keys):
        self.trainer = None
        self.slots = []
        for path in files:
            cfg = _config(seed, dataset_type="image_text", dataset_path=path, **keys)
            if self.trainer is None:
                self.trainer = SiteTrainer(cfg, contract)
                state, data = self.trainer.state, self.trainer.data
            else:
                from nvfp4_jax.federated.site import initial_state
                from nvfp4_jax.train import assembly

                run = assembly.assemble(cfg)
                state, data = initial_state(self.trainer.run), run.dataset("train")
            self.slots.append({"state": state, "data": data, "data_step": 0, "tokens": data.num_tokens})

    def train(self, i, params, samples, window):
        t, slot = self.trainer, self.slots[i]
        t.state, t.data, t.data_step = slot["state"], slot["data"], slot["data_step"]
        result = t.train_round(params, samples, window)
        slot.update(state=t.state, data_step=t.data_step)
        return result


def _fedavg(seed, contract, files, backbone, rounds, per_round, evaluator, **keys) -> dict:
    sites = _Sites(seed, contract, files, steps=max(1, rounds * per_round // (len(files) * BATCH)), **keys)
    trainer = sites.trainer
    global_params = {**trainer.initial_params(), **backbone}  # fresh adapters (B = 0) beside the backbone
    share = per_round // len(files)
    nominal = max(1, share // BATCH)
    uploads, start = [], time.perf_counter()
    for r in range(rounds):
        results = [sites.train(i, global_params, share, (r * nominal, (r + 1) * nominal)) for i in range(len(files))]
        weights = [float(s["tokens"] or 1) for s in sites.slots]
        total = sum(weights)
        for key in results[0].params:
            global_params[key] = sum(w * res.params[key] for w, res in zip(weights, results)) / total
        uploads.append(payload_bytes(results[0].params))
    seconds = time.perf_counter() - start
    scores = evaluator.scores(global_params)
    return {"vqa_accuracy": scores["vqa_accuracy"], "vqa_chance": scores["vqa_chance"],
            "vqa_questions": scores["vqa_questions"], "validation_loss": scores["validation_loss"],
            "upload_bytes_per_site_round": uploads[0], "full_model_bytes": payload_bytes(global_params),
            "train_seconds": seconds}


def _backbone(seed, public, steps) -> dict:
    trainer = SiteTrainer(_config(seed, dataset_type="image_text", dataset_path=public,
                                  steps=steps), UpdateContract(kind="full"))
    return trainer.train_round(trainer.initial_params(), steps * BATCH).params


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sites", default="4,8,16")
    p.add_argument("--alphas", default="0.3,10")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--samples-per-round", type=int, default=1024)
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vlm_federated.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.sites, args.alphas = 1, "4", "0.3"
    site_counts = [int(s) for s in args.sites.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    runs = []
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as work:
            public, private_ids, pool = _splits(seed, work)
            backbone = _backbone(seed, public, args.pretrain_steps)
            # The server's evaluation (dataset_type=digits: the job's held-out 20%), of the model with
            # and without adapters (their parameter trees differ).
            plain, adapted = Evaluator(_config(seed)), Evaluator(_config(seed, lora_rank=LORA_RANK))
            base = plain.scores(backbone)
            print(f"seed={seed} backbone vqa_accuracy={base['vqa_accuracy']:.4f} "
                  f"vqa_chance={base['vqa_chance']:.4f}", flush=True)
            adapters = UpdateContract(kind="adapters")
            central = _fedavg(seed, adapters, [pool], backbone, args.rounds, args.samples_per_round,
                              adapted, lora_rank=LORA_RANK)
            runs.append({"seed": seed, "method": "central", "sites": 1, "alpha": None,
                         "backbone_vqa_accuracy": base["vqa_accuracy"], **central})
            print(f"seed={seed} method=central vqa_accuracy={central['vqa_accuracy']:.4f}", flush=True)
            for n in site_counts:
                for alpha in alphas:
                    files = _site_files(seed, private_ids, n, alpha, work)
                    for method, contract, evaluator, keys in (
                            ("adapters", adapters, adapted, {"lora_rank": LORA_RANK}),
                            ("full", UpdateContract(kind="full"), plain, {})):
                        r = _fedavg(seed, contract, files, backbone, args.rounds, args.samples_per_round,
                                    evaluator, **keys)
                        runs.append({"seed": seed, "method": method, "sites": n, "alpha": alpha,
                                     "backbone_vqa_accuracy": base["vqa_accuracy"], **r})
                        print(f"seed={seed} method={method} sites={n} alpha={alpha} "
                              f"vqa_accuracy={r['vqa_accuracy']:.4f} traffic={r['upload_bytes_per_site_round']} "
                              f"of {r['full_model_bytes']} bytes", flush=True)
    summary = _summary(runs, site_counts, alphas)
    for row in summary:
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    write_json(Path(args.out), {"benchmark": "vlm_federated", "environment": environment(),
                          "settings": {**vars(args), "batch": BATCH, "public_fraction": PUBLIC_FRACTION,
                                       "lora_rank": LORA_RANK, "recipe": os.path.relpath(RECIPE, ROOT)},
                          "runs": runs, "summary": summary})
    return 0


def _summary(runs, site_counts, alphas) -> list[dict]:
    central = {r["seed"]: r["vqa_accuracy"] for r in runs if r["method"] == "central"}
    rows = []
    for n in site_counts:
        for alpha in alphas:
            row = {"sites": n, "alpha": alpha}
            for method in ("adapters", "full"):
                mine = [r for r in runs if r["method"] == method and r["sites"] == n and r["alpha"] == alpha]
                acc = [r["vqa_accuracy"] for r in mine]
                row[f"{method}_vqa_median"] = round(statistics.median(acc), 4)
                row[f"{method}_vqa_range"] = [round(min(acc), 4), round(max(acc), 4)]
                row[f"{method}_of_central_median"] = round(statistics.median(
                    [r["vqa_accuracy"] / central[r["seed"]] for r in mine]), 4)
            full = [r for r in runs if r["method"] == "full" and r["sites"] == n and r["alpha"] == alpha]
            adapter = [r for r in runs if r["method"] == "adapters" and r["sites"] == n and r["alpha"] == alpha]
            row["traffic_ratio_full_over_adapters"] = round(
                full[0]["upload_bytes_per_site_round"] / adapter[0]["upload_bytes_per_site_round"], 1)
            rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
