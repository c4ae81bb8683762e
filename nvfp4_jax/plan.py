"""`python -m nvfp4_jax.plan [config.yml] [key=value ...] [--num-devices N] [--device-memory-gib G]`.

Sizes a run on paper: builds the model abstractly (`jax.eval_shape`: nothing is allocated, so
405B plans on a laptop), then prints the parameter count, per-device memory under the configured
mesh, whether that fits the device, and the model FLOPs per step that TFLOP/s/device uses.

Memory model, per device, in bytes (a = 2 for bf16 compute, T = per-device batch x L tokens):

- State: fp32 parameters, fp32 gradients and AdamW's two fp32 moments, sharded like the
  parameters (FSDP splits every `embed` axis).
- Saved activations: what each decoder layer keeps for its backward pass, `T * s * a` per layer,
  where `s` values per token depend on `remat_policy` (the names are `checkpoint_name` tags):
  `none` everything (`4D + 2GK + HK + 3F`, plus the attention kernel's residuals:
  `dot_product` keeps fp32 probabilities, `4 H L` bytes a token; `cudnn_flash` a log-sum-exp,
  `4 H`; plus each quantized projection's operands the quantized dot keeps: its weight as the
  recipe stores it); `full` the layer input (`D`); `save_dot_except_mlp` input, Q, K, V and
  attention output projections (`2D + HK + 2GK`); `minimal` those and the MLP's gate and up
  (`+ 2F`); `minimal_with_context` those and the attention context (`+ HK`).
- Working set, live on top of that at the peak: with remat, one layer's full activations while
  it is recomputed; the weights FSDP gathers (compute dtype): scanned, the current and the next
  layer, unrolled, XLA may hoist every layer's gather, so all of them are counted; the gathered
  LM head (fp32 and its compute-dtype copy); the logits and their gradient in fp32 (`2 * 4V`
  per token), for `1 / num_vocab_tiling` of the tokens at a time.

It estimates what XLA keeps, good to a small factor; the plan says it fits only with 10% of the
device left for XLA's own buffers and fragmentation.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from nvfp4_jax import flops, projection, sharding
from nvfp4_jax.config import Config, ConfigError, ModelConfig, load_config

GIB = 1024**3
# Fraction of device memory a plan may use: the rest is for XLA's temporaries and fragmentation.
USABLE_FRACTION = 0.9
# Per-token values each decoder layer saves under a remat policy (besides "none"), as a function
# of the model's sizes. Mirrors model.llama.REMAT_SAVED_NAMES.
_SAVED_PER_TOKEN = {
    "full": lambda D, F, HK, GK: D,
    "save_dot_except_mlp": lambda D, F, HK, GK: 2 * D + HK + 2 * GK,
    "minimal": lambda D, F, HK, GK: 2 * D + HK + 2 * GK + 2 * F,
    "minimal_with_context": lambda D, F, HK, GK: 2 * D + 2 * HK + 2 * GK + 2 * F,
}
# Bytes per weight element a quantized dot keeps for its backward pass (emulated recipes):
# NVFP4 with 16x16 weight tiles keeps its quantized W as bf16 values, FP8 as FP8; the others keep
# the fp32 weight and requantize it.
_QUANTIZED_WEIGHT_BYTES = {("nvfp4", True): 2, ("fp8", False): 1}


@dataclass(frozen=True)
class Plan:
    parameters: int
    num_devices: int
    data: int
    fsdp: int
    parameter_bytes_per_device: float
    gradient_bytes_per_device: float
    optimizer_bytes_per_device: float
    saved_activation_bytes_per_device: float
    working_set_bytes_per_device: float
    flops_per_step: float
    global_batch_size: int
    attention_kernel: str = "dot_product"
    device_memory_bytes: float | None = None

    @property
    def activation_bytes_per_device(self) -> float:
        return self.saved_activation_bytes_per_device + self.working_set_bytes_per_device

    @property
    def total_bytes_per_device(self) -> float:
        return (self.parameter_bytes_per_device + self.gradient_bytes_per_device
                + self.optimizer_bytes_per_device + self.activation_bytes_per_device)

    @property
    def fits(self) -> bool | None:
        """None when the device memory is unknown."""
        if self.device_memory_bytes is None:
            return None
        return self.total_bytes_per_device <= USABLE_FRACTION * self.device_memory_bytes


def _shard_elements(shape, names, mesh_sizes) -> float:
    """Elements of one device's shard of an array with logical axis `names`."""
    rules = dict(sharding.LOGICAL_AXIS_RULES)
    count = 1.0
    for dim, name in zip(shape, names or (None,) * len(shape)):
        mesh_axes = rules.get(name) if name else None
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
        count *= math.ceil(dim / math.prod(mesh_sizes[a] for a in mesh_axes))
    return count


def _layer_weights(m: ModelConfig) -> tuple[int, int]:
    """(all matrix elements of one decoder layer, those of its MLP)."""
    D, F, H, G, K = m.base_emb_dim, m.base_mlp_dim, m.base_num_query_heads, m.base_num_kv_heads, m.head_dim
    mlp = 3 * D * F
    return mlp + 2 * D * H * K + 2 * D * G * K, mlp


def _quantized_residual_bytes(m: ModelConfig) -> float:
    """Weight bytes one decoder layer's quantized dots keep for the backward pass (no remat)."""
    from nvfp4_jax.quant import get_recipe
    from nvfp4_jax.train.build import ATTENTION_FP8_RECIPE

    total, mlp = _layer_weights(m)
    recipe = get_recipe(m.quantization)
    out = 0.0 if recipe.is_bf16 else mlp * _QUANTIZED_WEIGHT_BYTES.get((recipe.format, recipe.two_d_weights), 4)
    if m.attention_quantization == "fp8":
        attn = get_recipe(ATTENTION_FP8_RECIPE)
        out += (total - mlp) * _QUANTIZED_WEIGHT_BYTES.get((attn.format, attn.two_d_weights), 4)
    return out


def activation_bytes(m: ModelConfig, per_device_batch: int, attention_kernel: str) -> tuple[float, float]:
    """(saved activations, peak working set) per device, in bytes (see the module docstring)."""
    from nvfp4_jax.model import layer_blocks, layer_is_quantized

    D, F, L, V = m.base_emb_dim, m.base_mlp_dim, m.max_target_length, m.vocab_size
    HK, GK = m.base_num_query_heads * m.head_dim, m.base_num_kv_heads * m.head_dim
    H, N = m.base_num_query_heads, m.base_num_decoder_layers
    a = 2 if m.dtype == "bfloat16" else 4
    T = per_device_batch * L
    attention_residual = 4 * H * (L if attention_kernel == "dot_product" else 1)
    full_layer = T * ((4 * D + 2 * GK + HK + 3 * F) * a + attention_residual)
    quantized_layers = sum(layer_is_quantized(m, i) for i in range(N))
    quantized_residuals = quantized_layers * _quantized_residual_bytes(m)
    if m.remat_policy == "none":
        saved, recomputed_layer = N * full_layer + quantized_residuals, 0.0
    else:
        saved = N * T * _SAVED_PER_TOKEN[m.remat_policy](D, F, HK, GK) * a
        recomputed_layer = full_layer + quantized_residuals / max(quantized_layers, 1)
    layer_weights, _ = _layer_weights(m)
    scanned = any(block.scanned for block in layer_blocks(m))
    gathered = (2 if scanned else N) * layer_weights * a + D * V * (4 + a)
    logits = T * 2 * 4 * V / m.num_vocab_tiling
    return float(saved), float(recomputed_layer + gathered + logits)


def local_device_memory() -> float | None:
    """Bytes of memory of the local accelerator, or None on CPU or when it does not say."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    return float(stats["bytes_limit"]) if "bytes_limit" in stats else None


def make_plan(cfg: Config, num_devices: int, device_memory_bytes: float | None = None) -> Plan:
    from nvfp4_jax.model import Llama, select_attention

    data, fsdp = sharding.mesh_shape(cfg.mesh, num_devices)
    m = cfg.model
    # Parameter shapes depend on neither the dots nor the attention kernel (cuDNN's cannot even
    # be traced without a GPU).
    model = Llama(m, attention_kernel="dot_product")
    tokens = jax.ShapeDtypeStruct((1, min(m.max_target_length, 16)), jnp.int32)
    boxed = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t), tokens)["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    sizes = {"data": data, "fsdp": fsdp}
    parameters = sum(math.prod(leaf.value.shape) for leaf in leaves)
    shard = sum(_shard_elements(leaf.value.shape, leaf.names, sizes) for leaf in leaves)
    per_device_batch = cfg.train.per_device_batch_size
    kernel = select_attention(m.attention).kernel
    saved, working = activation_bytes(m, per_device_batch, kernel)
    global_batch = per_device_batch * num_devices
    return Plan(
        parameters=parameters,
        num_devices=num_devices,
        data=data,
        fsdp=fsdp,
        parameter_bytes_per_device=4 * shard,
        gradient_bytes_per_device=4 * shard,
        optimizer_bytes_per_device=8 * shard,
        saved_activation_bytes_per_device=saved,
        working_set_bytes_per_device=working,
        flops_per_step=flops.training_flops_per_step(m, global_batch, m.max_target_length),
        global_batch_size=global_batch,
        attention_kernel=kernel,
        device_memory_bytes=device_memory_bytes,
    )


def _verdict(plan: Plan) -> str:
    gib = lambda b: f"{b / GIB:,.1f} GiB"  # noqa: E731
    if plan.fits is None:
        return "fits: unknown (no accelerator here; give --device-memory-gib)"
    need, have = plan.total_bytes_per_device, plan.device_memory_bytes
    share = f"{need / have:.0%} of {gib(have)}"
    if plan.fits:
        return f"fits: yes, {gib(need)} per device = {share}, {gib(have - need)} to spare"
    return (f"fits: NO, {gib(need)} per device = {share} (at most {USABLE_FRACTION:.0%} is usable); "
            "try remat_policy=full, a larger num_vocab_tiling, scan_layers=true, "
            "attention=cudnn_flash, or a smaller per_device_batch_size")


def format_plan(cfg: Config, plan: Plan) -> str:
    m = cfg.model
    gib = lambda b: f"{b / GIB:,.2f} GiB"  # noqa: E731
    return "\n".join([
        f"model: {m.model_name} (quantization={m.quantization or 'bf16'})",
        f"parameters: {plan.parameters:,}",
        f"mesh: data={plan.data} x fsdp={plan.fsdp} ({plan.num_devices} devices)",
        f"global batch: {plan.global_batch_size} x {m.max_target_length} tokens",
        f"layout: attention={plan.attention_kernel} (asked: {m.attention}), scan_layers={m.scan_layers}, "
        f"remat_policy={m.remat_policy}, num_vocab_tiling={m.num_vocab_tiling}",
        "per-device memory:",
        f"  parameters (fp32):         {gib(plan.parameter_bytes_per_device)}",
        f"  gradients (fp32):          {gib(plan.gradient_bytes_per_device)}",
        f"  optimizer (AdamW, fp32):   {gib(plan.optimizer_bytes_per_device)}",
        f"  saved activations:         {gib(plan.saved_activation_bytes_per_device)}",
        f"  working set (peak):        {gib(plan.working_set_bytes_per_device)}",
        f"  total (estimate):          {gib(plan.total_bytes_per_device)}",
        _verdict(plan),
        f"model FLOPs per step: {plan.flops_per_step:.4e} "
        f"({plan.flops_per_step / plan.num_devices / 1e12:,.1f} TFLOP per device)",
    ])


def check_numeric_options(args: argparse.Namespace) -> None:
    """ConfigError naming the first numeric command-line option that is given but is not a
    positive, finite number (a device count of 0 divides by zero, a negative one plans negative
    memory, `inf` memory fits anything, `nan` compares false). Every option of `main` that takes
    a number goes through here, so a new one is checked by being declared."""
    for name, value in vars(args).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name.replace('_', '-')}={value!r} is not allowed: must be a positive, "
                              "finite number.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvfp4_jax.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--num-devices", type=int, default=None,
                        help="devices to plan for (default: the product of the mesh keys, or with a -1 "
                             "mesh key, the devices of this machine)")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="memory of one device (default: the local accelerator's, if any)")
    parser.add_argument("--project", choices=sorted(projection.DEVICES), default=None,
                        help="also project the step time per recipe on this GPU (docs/backends.md)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        check_numeric_options(args)
        cfg = load_config(rest)
        num_devices = args.num_devices
        if num_devices is None:
            axes = (cfg.mesh.dcn_data_parallelism, cfg.mesh.ici_data_parallelism, cfg.mesh.ici_fsdp_parallelism)
            # With a -1 axis, plan as a run would: for the devices this machine has.
            num_devices = jax.device_count() if -1 in axes else math.prod(axes)
        memory = args.device_memory_gib * GIB if args.device_memory_gib is not None else local_device_memory()
        plan = make_plan(cfg, num_devices, memory)
    except ConfigError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(format_plan(cfg, plan))
    if args.project:
        device = projection.DEVICES[args.project]
        estimates = projection.project(cfg.model, device, per_device_batch=cfg.train.per_device_batch_size,
                                       seq_len=cfg.model.max_target_length, num_devices=num_devices)
        print(projection.format_projection(cfg.model, device, estimates))
    return 1 if plan.fits is False else 0


if __name__ == "__main__":
    sys.exit(main())
