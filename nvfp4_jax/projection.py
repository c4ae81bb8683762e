"""Projected step time per recipe on a datacenter GPU, from published peak rates (`plan --project`).

A roofline sum per device and step, nothing fitted (docs/backends.md, "Projection", says why each
term is what it is):

    GEMMs         model FLOPs of each GEMM class / (its precision's dense peak * GEMM_EFFICIENCY)
                  MLP: the recipe's format (`quantization` applies to the MLP only); attention
                  projections: BF16 (or FP8 with attention_quantization=fp8); LM head: BF16;
                  attention core (flash attention, BF16): fwd QK^T and PV, causal, bwd 2.5x fwd.
    elementwise   activation bytes of norms, residual adds, SwiGLU, RoPE (fwd + 2x bwd), bf16,
                  plus the optimizer's update of this device's parameter shard
    quantization  bytes each quantizer reads and writes (per MLP GEMM: two copies of X, two of dY,
                  one W; FP8 delayed scaling one pass, NVFP4 an amax pass then a quantize pass)
    memory terms  / (HBM bandwidth * BANDWIDTH_EFFICIENCY)
    collectives   FSDP all-gathers (fwd, bwd) and reduce-scatter over NVLink: assumed hidden
                  behind compute; the part that is not (if any) is added

On Hopper (no FP4 tensor cores) NVFP4 is the emulated recipe: its MLP GEMMs run at the BF16 rate.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from nvfp4_jax.config import ModelConfig
from nvfp4_jax.quant.recipe import get_recipe

# Measured by this project on an H200 (jax 0.11.2, CUDA 13): a bf16 GEMM of
# 8192x4096x14336 (the Llama 3 8B MLP shape) at ~580 TFLOP/s of the 989 TFLOP/s dense peak, and a
# device copy at ~3.9 TB/s of the 4.8 TB/s HBM peak. One factor each, used for every GEMM and
# every memory-bound term on every device.
GEMM_EFFICIENCY = 580.0 / 989.0
BANDWIDTH_EFFICIENCY = 3.9 / 4.8
# The decisive assumption, unmeasured here (no Blackwell GPU): that FP4 GEMMs reach the BF16
# GEMM's efficiency. The band printed beside each projection takes FP4 GEMMs from about 3/4 to
# 6/5 of it; on NVIDIA's four published rows that moves the projected speedups by -15%..+5%.
FP4_GEMM_EFFICIENCY_BOUNDS = (0.45, 0.70)


@dataclasses.dataclass(frozen=True)
class Device:
    """Published dense (non-sparse) peak rates of one GPU, TFLOP/s, and bandwidths, TB/s."""

    name: str
    bf16: float
    fp8: float
    fp4: float | None  # None: no FP4 tensor cores
    hbm: float
    nvlink: float  # per direction
    source: str


DEVICES: Mapping[str, Device] = {
    "h100": Device("H100 SXM", 989.0, 1979.0, None, 3.35, 0.45,
                   "https://www.nvidia.com/en-us/data-center/h100/ (sparse figures halved)"),
    "h200": Device("H200 SXM", 989.0, 1979.0, None, 4.8, 0.45,
                   "https://www.nvidia.com/en-us/data-center/h200/ (sparse figures halved)"),
    "b200": Device("B200 (HGX B200)", 2250.0, 4500.0, 9000.0, 8.0, 0.9,
                   "https://www.nvidia.com/en-us/data-center/hgx/ HGX B200 per GPU (dense)"),
    "gb200": Device("GB200 NVL72 Blackwell GPU", 2500.0, 5000.0, 10000.0, 8.0, 0.9,
                    "https://www.nvidia.com/en-us/data-center/gb200-nvl72/ rack figures / 72, sparse halved"),
    "gb300": Device("GB300 NVL72 Blackwell Ultra GPU", 2500.0, 5000.0, 15000.0, 8.0, 0.9,
                    "https://www.nvidia.com/en-us/data-center/gb300-nvl72/ rack figures / 72 (FP4 dense)"),
}

# The quantization flags projected (the recipes themselves come from quant.recipe.RECIPES).
RECIPES = ("bf16", "te_fp8_delayedscaling", "te_nvfp4", "te_nvfp4_no_rht")
_RATE_FORMAT = {"bf16": "bf16", "fp8": "fp8", "nvfp4": "fp4", "mxfp4": "fp4"}  # recipe format -> tensor cores
# Bytes written per quantized element: FP8 one; NVFP4 half a byte plus one E4M3 scale per 16.
_WRITE_BYTES = {"fp8": 1.0, "fp4": 0.5 + 1.0 / 16}
_READ_PASSES = {"fp8": 1, "fp4": 2}  # delayed-scaling FP8: one pass; NVFP4: amax, then quantize


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """Seconds per step of one recipe, and its terms."""

    recipe: str
    seconds: float
    terms: Mapping[str, float]
    # FP4 recipes: seconds at the FP4 GEMM efficiency bounds (slowest, fastest); None otherwise.
    band: tuple[float, float] | None = None


def _rate(device: Device, fmt: str, fp4_efficiency: float = GEMM_EFFICIENCY) -> float:
    if fmt == "fp4" and device.fp4:
        return device.fp4 * 1e12 * fp4_efficiency
    tflops = {"bf16": device.bf16, "fp8": device.fp8, "fp4": device.bf16}[fmt]
    return tflops * 1e12 * GEMM_EFFICIENCY


def project(
    cfg: ModelConfig, device: Device, *, per_device_batch: int, seq_len: int, num_devices: int,
    fp4_gemm_efficiency: float | None = None,
) -> dict[str, StepEstimate]:
    """Projected step time of each recipe in RECIPES for `cfg` on `device` under FSDP.

    `fp4_gemm_efficiency` (default GEMM_EFFICIENCY) is the fraction of the FP4 peak that FP4
    GEMMs reach. At the default, each FP4 recipe's estimate carries its `band`: its seconds at
    FP4_GEMM_EFFICIENCY_BOUNDS (on a GPU without FP4 tensor cores the band is a point)."""
    fp4_eff = GEMM_EFFICIENCY if fp4_gemm_efficiency is None else fp4_gemm_efficiency
    T = per_device_batch * seq_len  # tokens per device
    D, F, K, V = cfg.base_emb_dim, cfg.base_mlp_dim, cfg.head_dim, cfg.vocab_size
    H, G, N = cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.base_num_decoder_layers
    bw = device.hbm * 1e12 * BANDWIDTH_EFFICIENCY
    attention_fmt = "fp8" if cfg.attention_quantization == "fp8" else "bf16"
    # Model FLOPs, forward + backward (x3), per device.
    mlp = 3 * 2 * T * 3 * D * F * N
    projections = 3 * 2 * T * (D * (H + 2 * G) * K + H * K * D) * N
    head = 3 * 2 * T * D * V
    core = 3.5 * (4 * T * seq_len * H * K / 2) * N  # flash attention: bwd 2.5x fwd, causal
    # Elementwise activation traffic per token and layer, bf16, fwd + 2x bwd.
    act_bytes = 3 * 2 * (2 * 2 * D + 3 * D + 3 * F + 2 * (H + G) * K)
    params = N * (D * (H + 2 * G) * K + H * K * D + 3 * D * F) + 2 * V * D
    optimizer_bytes = 28 * params / num_devices  # fp32 param, grad, two moments: read + write
    comm_bytes = 3 * 2 * params * (num_devices - 1) / num_devices  # gathers fwd+bwd, scatter, bf16
    shared = {
        "attention projections": projections / _rate(device, attention_fmt),
        "attention core": core / _rate(device, "bf16"),
        "LM head": head / _rate(device, "bf16"),
        "elementwise": (T * N * act_bytes + optimizer_bytes) / bw,
    }
    out = {}
    for recipe in RECIPES:
        fmt = _RATE_FORMAT[get_recipe(recipe).format]
        terms = dict(shared, **{"MLP GEMMs": mlp / _rate(device, fmt, fp4_eff), "quantization": 0.0})
        if fmt != "bf16":
            # Per layer: gate, up (X: T x D each) and down (X: T x F); dY of gate/up T x F, of
            # down T x D; weights D x F. Two copies of X and dY, one of W (FP8: two).
            x_elems = 2 * T * D + T * F
            dy_elems = 2 * T * F + T * D
            w_elems = 3 * D * F * (2 if fmt == "fp8" else 1)
            per_copy = 2.0 * _READ_PASSES[fmt] + _WRITE_BYTES[fmt]
            elems = 2 * (x_elems + dy_elems) + w_elems
            terms["quantization"] = N * elems * per_copy / bw
            if get_recipe(recipe).rht_wgrad:  # the 16x16 RHT of both WGRAD operands, in its two passes
                terms["quantization"] += N * 2 * (x_elems + dy_elems) * 2 * 32 / _rate(device, "bf16")
        compute = sum(terms.values())
        terms["exposed collectives"] = max(0.0, comm_bytes / (device.nvlink * 1e12) - compute)
        out[recipe] = StepEstimate(recipe, sum(terms.values()), terms)
    if fp4_gemm_efficiency is None:
        low, high = (project(cfg, device, per_device_batch=per_device_batch, seq_len=seq_len,
                             num_devices=num_devices, fp4_gemm_efficiency=e) for e in FP4_GEMM_EFFICIENCY_BOUNDS)
        for recipe in RECIPES:
            if _RATE_FORMAT[get_recipe(recipe).format] == "fp4":
                out[recipe] = dataclasses.replace(out[recipe], band=(low[recipe].seconds, high[recipe].seconds))
    return out


def format_projection(cfg: ModelConfig, device: Device, estimates: Mapping[str, StepEstimate]) -> str:
    names = list(next(iter(estimates.values())).terms)
    lines = [f"projected step time on {device.name} ({device.source}):",
             f"  {'recipe':<23}{'step s':>9}  " + "  ".join(f"{n:>12.12}" for n in names)]
    for e in estimates.values():
        lines.append(f"  {e.recipe:<23}{e.seconds:>9.4f}  " + "  ".join(f"{e.terms[n]:>12.4f}" for n in names))
    fp8, nvfp4 = estimates["te_fp8_delayedscaling"].seconds, estimates["te_nvfp4"]
    band = ""
    if nvfp4.band and device.fp4:
        lo, hi = FP4_GEMM_EFFICIENCY_BOUNDS
        band = (f" (range {fp8 / nvfp4.band[0]:.2f}x-{fp8 / nvfp4.band[1]:.2f}x for FP4 GEMM efficiency "
                f"{lo:.2f}-{hi:.2f}, the assumption it depends on most)")
    lines.append(f"  projected NVFP4 (te_nvfp4) over FP8 speedup: {fp8 / nvfp4.seconds:.2f}x{band}"
                 + ("" if device.fp4 else " (no FP4 tensor cores: NVFP4 runs emulated at the BF16 rate)"))
    lines.append(f"  assumptions: GEMM efficiency {GEMM_EFFICIENCY:.2f}, bandwidth efficiency "
                 f"{BANDWIDTH_EFFICIENCY:.2f} (measured on H200); FSDP collectives overlapped; see docs/backends.md")
    return "\n".join(lines)
