"""The update contract: what a site sends back each round, declared in one place.

- `kind`: `full` (the site's new parameters), `diff` (new minus the round's global model; FedAvg
  adds the weighted mean of the differences), `subset`: only the trainable parameters (a
  frozen backbone: `trainable=mlp` or `trainable=last:N`), sent as differences, or `adapters`:
  only the LoRA adapters (a model with `lora_rank > 0`, its backbone frozen on every site), sent
  as differences; `adapters` with `trainable` (e.g. `projector`, a VLM's): the adapters and
  those leaves. Under `subset` and `adapters` the rest of the model never changes on a site and
  never travels, in either direction: every site starts from the same backbone as the server
  (the same `seed`, or the same `load_parameters_path`), and the server sends only the trained
  leaves (`server.BudgetedFedAvg._sent_model`).
- `compression`: `none`, `fp8` (E4M3 with one fp32 scale per tensor) or `nvfp4` (E2M1 codes in
  16-element blocks with E4M3 block scales and an fp32 tensor scale, this project's quantizer).
  Only differences are compressed. The site keeps the compression error and adds it to the next
  round's update (error feedback), so what it transmits over the rounds adds up to what it
  trained: `decode(sent) + residual == update + previous residual`.

Parameters travel as a flat `{"path/to/leaf": float32 array}` dict (FLARE's NumPy exchange
format); a compressed leaf travels as a few arrays under `path::codes`, `path::scales`, ... and is
decoded on the server before FedAvg averages it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import ml_dtypes
import numpy as np

KINDS = ("full", "diff", "subset", "adapters")
# The names of a LoRA adapter's two matrices (nvfp4_jax.model.lora.ADAPTER_LEAVES: this module
# stays jax-free for the FLARE server).
_ADAPTER_LEAVES = ("lora_a", "lora_b")
COMPRESSIONS = ("none", "fp8", "nvfp4")
# What FedAvg weights each site's update by: its training data (tokens, FedAvg's definition), or
# the samples it trained this round.
WEIGHTINGS = ("data", "samples")
_SEP = "::"
_E4M3_MAX = 448.0
_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class UpdateContract:
    kind: str = "diff"
    trainable: str = "all"  # all | mlp | projector (a VLM's) | last:N (layers) | a regex over leaf paths
    compression: str = "none"

    @property
    def sends_difference(self) -> bool:
        return self.kind in ("diff", "subset", "adapters")

    @property
    def frozen_backbone(self) -> bool:
        """Whether part of the model never trains on a site (and so never travels)."""
        return self.kind in ("subset", "adapters")


def check_contract(c: UpdateContract) -> None:
    if c.kind not in KINDS:
        raise ValueError(f"update={c.kind!r} is not one of {', '.join(KINDS)}")
    if c.compression not in COMPRESSIONS:
        raise ValueError(f"compression={c.compression!r} is not one of {', '.join(COMPRESSIONS)}")
    if c.compression != "none" and not c.sends_difference:
        raise ValueError(f"compression={c.compression} compresses differences: use update=diff or update=subset")
    if c.kind not in ("subset", "adapters") and c.trainable != "all":
        raise ValueError(f"trainable={c.trainable!r} needs update=subset or update=adapters (a frozen backbone)")
    if c.kind == "subset" and c.trainable == "all":
        raise ValueError("update=subset needs trainable=mlp, trainable=last:N or a pattern over parameter paths")
    if c.trainable.startswith("last:"):
        n = c.trainable[5:]
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"trainable={c.trainable!r}: N in last:N must be a positive integer")
    elif c.trainable not in NAMED:
        try:
            re.compile(c.trainable)
        except re.error as exc:
            raise ValueError(f"trainable={c.trainable!r} is not a valid regular expression: {exc}") from None


# The named selections of `trainable` (else last:N or a regular expression).
NAMED = ("all", "mlp", "projector")
_LAYER = re.compile(r"(?:^|/)layers_(\d+)/")


def trainable_paths(c: UpdateContract, paths: list[str], num_layers: int) -> list[str]:
    """The leaf paths a site trains and sends, in `paths`' order."""
    if c.kind == "adapters":
        adapters = {p for p in paths if p.rsplit("/", 1)[-1] in _ADAPTER_LEAVES}
        if not adapters:
            raise ValueError("update=adapters needs a model with LoRA adapters: set lora_rank > 0")
        extra = set() if c.trainable == "all" else set(_selected(c.trainable, paths, num_layers))
        return [p for p in paths if p in adapters or p in extra]
    if c.trainable == "all":
        return list(paths)
    return _selected(c.trainable, paths, num_layers)


def _selected(trainable: str, paths: list[str], num_layers: int) -> list[str]:
    """The paths a `trainable` other than `all` selects (ValueError when none)."""
    if trainable == "mlp":
        chosen = [p for p in paths if "/mlp/" in p]
    elif trainable == "projector":
        chosen = [p for p in paths if p.startswith("projector/")]
    elif trainable.startswith("last:"):
        first = num_layers - int(trainable[5:])
        chosen = [p for p in paths if (m := _LAYER.search(p)) and int(m.group(1)) >= first]
    else:
        pattern = re.compile(trainable)
        chosen = [p for p in paths if pattern.search(p)]
    if not chosen:
        raise ValueError(f"trainable={trainable!r} selects no parameter (paths look like {paths[0]!r})")
    return chosen


# --- compression ---------------------------------------------------------------------------


def _encode_fp8(x: np.ndarray) -> dict[str, np.ndarray]:
    amax = float(np.max(np.abs(x))) if x.size else 0.0
    scale = np.float32(_E4M3_MAX / amax) if amax > 0 else np.float32(1.0)
    data = (x.astype(np.float32) * scale).astype(ml_dtypes.float8_e4m3fn)
    return {"data": data.view(np.uint8), "scale_inv": np.asarray(1.0 / scale, np.float32)}


def _decode_fp8(parts: Mapping[str, np.ndarray], shape) -> np.ndarray:
    data = np.asarray(parts["data"]).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (data * np.float32(parts["scale_inv"])).reshape(shape)


def _encode_nvfp4(x: np.ndarray) -> dict[str, np.ndarray]:
    # jax only for nvfp4 compression: the FLARE server otherwise runs without it
    import jax.numpy as jnp

    from nvfp4_jax.quant import quantize_nvfp4

    flat = x.astype(np.float32).reshape(-1)
    pad = (-flat.size) % _BLOCK
    rows = np.concatenate([flat, np.zeros(pad, np.float32)]).reshape(-1, _BLOCK)
    q = quantize_nvfp4(jnp.asarray(rows))
    return {
        "codes": np.asarray(q.codes),
        "scales": np.asarray(q.scales).view(np.uint8),
        "amax": np.asarray(q.amax, np.float32),
    }


def _decode_nvfp4(parts: Mapping[str, np.ndarray], shape) -> np.ndarray:
    # jax only for nvfp4 compression: the FLARE server otherwise runs without it
    import jax.numpy as jnp
    from nvfp4_jax.quant import NVFP4Tensor, dequantize

    codes = np.asarray(parts["codes"])
    rows = codes.shape[0]
    q = NVFP4Tensor(
        codes=jnp.asarray(codes),
        scales=jnp.asarray(np.asarray(parts["scales"]).view(ml_dtypes.float8_e4m3fn)),
        amax=jnp.asarray(np.asarray(parts["amax"], np.float32)),
        shape=(rows, _BLOCK), axis=1,
    )
    flat = np.asarray(dequantize(q, jnp.float32)).reshape(-1)
    size = int(np.prod(shape)) if len(shape) else 1
    return flat[:size].reshape(shape)


_CODECS = {"fp8": (_encode_fp8, _decode_fp8), "nvfp4": (_encode_nvfp4, _decode_nvfp4)}


def all_finite(arrays: Mapping[str, np.ndarray]) -> bool:
    """Whether every value of every array is finite: a NaN or Inf update is never averaged in."""
    return all(bool(np.isfinite(np.asarray(v, np.float32)).all()) for v in arrays.values())


def encode(update: Mapping[str, np.ndarray], compression: str,
           residual: Mapping[str, np.ndarray] | None = None):
    """`(payload, shapes, new_residual)`: the arrays to transmit, each leaf's shape, and the
    compression error the site keeps (error feedback). `compression="none"` sends `update` as is."""
    if compression == "none":
        return {k: np.asarray(v, np.float32) for k, v in update.items()}, {}, {}
    enc, dec = _CODECS[compression]
    payload, shapes, new_residual = {}, {}, {}
    for name, value in update.items():
        v = np.asarray(value, np.float32)
        if residual is not None and name in residual:
            v = v + residual[name]
        parts = enc(v)
        new_residual[name] = v - dec(parts, v.shape)
        shapes[name] = list(v.shape)
        for part, array in parts.items():
            payload[f"{name}{_SEP}{part}"] = array
    return payload, shapes, new_residual


def decode(payload: Mapping[str, np.ndarray], compression: str, shapes: Mapping[str, list]) -> dict[str, np.ndarray]:
    """The float32 update a payload from `encode` stands for."""
    if compression == "none":
        return {k: np.asarray(v, np.float32) for k, v in payload.items()}
    _, dec = _CODECS[compression]
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for key, array in payload.items():
        name, _, part = key.rpartition(_SEP)
        grouped.setdefault(name, {})[part] = array
    missing = set(shapes) ^ set(grouped)
    if missing:
        raise ValueError(f"compressed update does not match its shapes: {sorted(missing)[:3]}")
    return {name: dec(parts, tuple(shapes[name])) for name, parts in grouped.items()}


def payload_bytes(payload: Mapping[str, np.ndarray]) -> int:
    """Bytes of array data a payload carries (what the contract costs on the wire, before
    FLARE's own framing)."""
    return int(sum(np.asarray(v).nbytes for v in payload.values()))
