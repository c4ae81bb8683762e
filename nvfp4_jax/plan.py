"""`python -m nvfp4_jax.plan [config.yml] [key=value ...] [--num-devices N] [--device-memory-gib G] [--max-context]`.

Sizes a run on paper: builds the model abstractly (`jax.eval_shape`: nothing is allocated, so
405B plans on a laptop), then prints the parameter count, per-device memory under the configured
mesh, whether that fits the device, and the model FLOPs per step that TFLOP/s/device uses.

Memory model, per device, in bytes (a = 2 for bf16 compute, T = this device's tokens: its
`global batch / (data x fsdp)` rows times `L / context`; under `ici_tensor_parallelism=t` every
head-, KV- and MLP-sized term below is divided by t, D-sized ones are not):

- State: fp32 parameters, fp32 gradients and AdamW's two fp32 moments, sharded like the
  parameters (every `embed` axis over fsdp x context, heads and MLP width over tensor).
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

With context parallelism, `all_gather` also keeps each layer's gathered K and V; Ulysses' device
holds L queries of H / context heads, the same probability bytes as `dot_product` above.
`--max-context` searches the longest `max_target_length` that fits, up to the longest the trainer
accepts (`config.INT32_MAX` = 2,147,483,647: positions are int32 on the device; a plan that
reaches it says so); the communication lines give
the bytes each device sends per layer for Ulysses, all_gather and ring attention
(`communication_bytes`).

It estimates what XLA keeps, good to a small factor; the plan says it fits only with 10% of the
device left for XLA's own buffers and fragmentation.

Exit codes: 0 planned (it fits, or no device memory is known), 2 bad input (one `error: ...`
line), 5 planned but it does not fit the device (the plan is printed; 1 stays a crash).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from nvfp4_jax import config as config_lib
from nvfp4_jax import flops, projection, sharding
from nvfp4_jax.cli import CommandParser, Exit, debug_requested, fail
from nvfp4_jax.config import Config, ConfigError, ModelConfig, load_config
from nvfp4_jax.model import Llama, layer_blocks, layer_is_quantized, select_attention
from nvfp4_jax.model.ulysses import kv_repeats

GIB = 1024**3
EXIT_CODES = (f"exit codes: {Exit.OK:d} planned (it fits, or no device memory is known); {Exit.BAD_INPUT:d} bad "
              f"input (one `error: ...` line); {Exit.DOES_NOT_FIT:d} planned, but it does not fit the device (the "
              "plan is printed, `fits: NO`); 1 is a crash (a bug).")
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
# NVFP4 with 16x16 and MXFP4 with 32x32 weight tiles keep their quantized W as bf16 values, FP8
# as FP8; the others keep the fp32 weight and requantize it.
_QUANTIZED_WEIGHT_BYTES = {("nvfp4", True): 2, ("mxfp4", True): 2, ("fp8", False): 1}


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
    context: int = 1
    tensor: int = 1
    communication: "Communication | None" = None

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
    total, mlp = _layer_weights(m)
    recipe = m.mlp_recipe
    out = 0.0 if recipe.is_bf16 else mlp * _QUANTIZED_WEIGHT_BYTES.get((recipe.format, recipe.two_d_weights), 4)
    if m.attention_quantization == "fp8":
        attn = m.attention_recipe
        out += (total - mlp) * _QUANTIZED_WEIGHT_BYTES.get((attn.format, attn.two_d_weights), 4)
    return out


def activation_bytes(m: ModelConfig, rows_per_device: float, attention_kernel: str, *,
                     context: int = 1, tensor: int = 1, strategy: str = "all_gather") -> tuple[float, float]:
    """(saved activations, peak working set) per device, in bytes (see the module docstring).

    `rows_per_device` sequences are split `context` ways along L and `tensor` ways along the
    heads and the MLP width: each device holds `rows * L / context` tokens, with every D-sized
    activation whole and every H-, G- or F-sized one divided by `tensor`.
    """
    D, F, L, V = m.base_emb_dim, m.base_mlp_dim / tensor, m.max_target_length, m.vocab_size
    HK, GK = m.base_num_query_heads * m.head_dim / tensor, m.base_num_kv_heads * m.head_dim / tensor
    H, N = m.base_num_query_heads / tensor, m.base_num_decoder_layers
    a = 2 if m.dtype == "bfloat16" else 4
    T = rows_per_device * L / context
    # Per query token: dot_product keeps fp32 probabilities over all L keys (so does Ulysses,
    # whose device holds L queries of H/context heads: the same bytes), the fused kernels a
    # log-sum-exp per head. all_gather also keeps each layer's gathered K and V (whole sequence).
    attention_residual = 4 * H * (L if attention_kernel == "dot_product" else 1)
    gathered_kv = 2 * GK * a * (context - 1) if strategy == "all_gather" else 0.0
    full_layer = T * ((4 * D + 2 * GK + HK + 3 * F) * a + attention_residual + gathered_kv)
    quantized_layers = sum(layer_is_quantized(m, i) for i in range(N))
    quantized_residuals = quantized_layers * _quantized_residual_bytes(m) / tensor
    if m.remat_policy == "none":
        saved, recomputed_layer = N * full_layer + quantized_residuals, 0.0
    else:
        saved = N * T * _SAVED_PER_TOKEN[m.remat_policy](D, F, HK, GK) * a
        recomputed_layer = full_layer + quantized_residuals / max(quantized_layers, 1)
    layer_weights, _ = _layer_weights(m)
    scanned = any(block.scanned for block in layer_blocks(m))
    gathered = (2 if scanned else N) * layer_weights / tensor * a + D * V * (4 + a)
    logits = T * 2 * 4 * V / m.num_vocab_tiling
    return float(saved), float(recomputed_layer + gathered + logits)


@dataclass(frozen=True)
class Communication:
    """Bytes one device sends per decoder layer and training step (forward + backward)."""

    context: float  # the chosen context-parallel strategy's exchanges
    ulysses: float
    all_gather: float
    ring: float  # ring attention's, for comparison (not implemented here)
    tensor: float  # Megatron's all-reduces of the block outputs


def communication_bytes(m: ModelConfig, rows_per_device: float, context: int, tensor: int) -> Communication:
    """Per device and layer. With `c = context`, `t = tensor`, `a` bytes per compute value and
    this device's `T = rows * L / c` tokens:

    - ulysses: all-to-alls of q, k, v and the output forward, of their gradients backward; each
      sends (c-1)/c of its `[T, heads/t, K]` shard: `2 * (c-1)/c * T * (2 H + 2 G') K a / t`,
      where G' = G repeated up to a multiple of c. O(L D / c).
    - all_gather: K and V gathered forward (receive (c-1) shards each), their gradients
      reduce-scattered backward: `2 * (c-1) * T * 2 G K a / t`. O(L G K).
    - ring: K and V passed around the ring c-1 times forward, K, V, dK, dV backward:
      `3 * (c-1) * T * 2 G K a / t`. O(L G K).
    - tensor: the attention and MLP outputs all-reduced forward, their input gradients backward
      (a ring all-reduce sends 2 (t-1)/t of the buffer): `4 * 2 (t-1)/t * T * D * a`.
    """
    H, G, K, D = m.base_num_query_heads, m.base_num_kv_heads, m.head_dim, m.base_emb_dim
    a = 2 if m.dtype == "bfloat16" else 4
    T = rows_per_device * m.max_target_length / context
    g_local = max(G // tensor, 1)
    repeated = g_local * (kv_repeats(g_local, H // tensor, context) if (H // tensor) % context == 0 else 1)
    ulysses = 2 * (context - 1) / context * T * (2 * H / tensor + 2 * repeated) * K * a
    all_gather = 2 * (context - 1) * T * 2 * G * K * a / tensor
    ring = 3 * (context - 1) * T * 2 * G * K * a / tensor
    tp = 4 * 2 * (tensor - 1) / tensor * T * D * a
    chosen = ulysses if m.context_parallel_strategy == "ulysses" else all_gather
    return Communication(chosen, ulysses, all_gather, ring, tp)


def local_device_memory() -> float | None:
    """Bytes of memory of the local accelerator, or None on CPU or when it does not say."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    return float(stats["bytes_limit"]) if "bytes_limit" in stats else None


@functools.lru_cache(maxsize=None)
def _parameter_counts(m: ModelConfig, shape: sharding.MeshShape) -> tuple[int, float]:
    """(parameters, elements of one device's shard); independent of the sequence length."""
    # Parameter shapes depend on neither the dots nor the attention kernel (cuDNN's cannot even
    # be traced without a GPU).
    model = Llama(m, attention_kernel="dot_product")
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    boxed = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t), tokens)["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    sizes = shape._asdict()
    parameters = sum(math.prod(leaf.value.shape) for leaf in leaves)
    return parameters, sum(_shard_elements(leaf.value.shape, leaf.names, sizes) for leaf in leaves)


def make_plan(cfg: Config, num_devices: int, device_memory_bytes: float | None = None) -> Plan:
    """The plan of `cfg` on `num_devices`; ConfigError for a mesh or batch the run would refuse."""
    shape = sharding.mesh_shape(cfg.mesh, num_devices)
    sharding.check_mesh_sizes(cfg, shape, num_devices)
    m = cfg.model
    parameters, shard = _parameter_counts(dataclasses.replace(m, max_target_length=16), shape)
    global_batch = sharding.global_batch_size(cfg.train.per_device_batch_size, num_devices)
    rows = global_batch / (shape.data * shape.fsdp)
    kernel = select_attention(m.attention, seq_len=m.max_target_length).kernel
    saved, working = activation_bytes(m, rows, kernel, context=shape.context, tensor=shape.tensor,
                                      strategy=m.context_parallel_strategy)
    return Plan(
        parameters=parameters,
        num_devices=num_devices,
        data=shape.data,
        fsdp=shape.fsdp,
        parameter_bytes_per_device=4 * shard,
        gradient_bytes_per_device=4 * shard,
        optimizer_bytes_per_device=8 * shard,
        saved_activation_bytes_per_device=saved,
        working_set_bytes_per_device=working,
        flops_per_step=flops.training_flops_per_step(m, global_batch, m.max_target_length),
        global_batch_size=global_batch,
        attention_kernel=kernel,
        device_memory_bytes=device_memory_bytes,
        context=shape.context,
        tensor=shape.tensor,
        communication=communication_bytes(m, rows, shape.context, shape.tensor),
    )


def _length_block(cfg: Config, num_devices: int) -> int:
    """What every `max_target_length` the run accepts is a multiple of."""
    m = cfg.model
    return math.lcm((config_lib._block_size(m.quantization) or 1) * sharding.mesh_shape(cfg.mesh, num_devices).context,
                    m.num_vocab_tiling)


def max_context(cfg: Config, num_devices: int, device_memory_bytes: float) -> tuple[int, Plan | None]:
    """The longest `max_target_length` whose plan fits (0 and None when none does), searched over
    the lengths the run accepts: multiples of the context parallelism times the quantizer's block
    (16 for NVFP4; 1 without blocks), and of `num_vocab_tiling`, no longer than
    `config.INT32_MAX` (the trainer refuses longer ones: positions are int32)."""
    m = cfg.model
    block = _length_block(cfg, num_devices)

    def plan_at(units: int) -> Plan | None:
        trial = dataclasses.replace(cfg, model=dataclasses.replace(m, max_target_length=units * block))
        try:
            return make_plan(trial, num_devices, device_memory_bytes)
        except ConfigError:
            return None

    def fits(units: int) -> bool:
        p = plan_at(units)
        return bool(p and p.fits)

    most = config_lib.INT32_MAX // block  # the longest length the trainer accepts, in blocks
    if most < 1 or not fits(1):
        return 0, None
    if fits(most):
        return most * block, plan_at(most)
    hi = 1
    while hi * 2 < most and fits(hi * 2):
        hi *= 2
    lo, hi = hi, min(hi * 2, most)  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * block, plan_at(lo)


def _verdict(plan: Plan) -> str:
    gib = lambda b: f"{b / GIB:,.1f} GiB"  # noqa: E731
    if plan.fits is None:
        return "fits: unknown (no accelerator here; give --device-memory-gib)"
    need, have = plan.total_bytes_per_device, plan.device_memory_bytes
    share = f"{need / have:.0%} of {gib(have)}"
    if plan.fits:
        return f"fits: yes, {gib(need)} per device = {share}, {gib(have - need)} to spare"
    state = plan.parameter_bytes_per_device + plan.gradient_bytes_per_device + plan.optimizer_bytes_per_device
    biggest = max(("the training state", state), ("saved activations", plan.saved_activation_bytes_per_device),
                  ("the working set", plan.working_set_bytes_per_device), key=lambda kv: kv[1])
    return (f"fits: NO, {gib(need)} per device = {share} (at most {USABLE_FRACTION:.0%} is usable; "
            f"largest part: {biggest[0]}, {gib(biggest[1])}); "
            "try remat_policy=full, a larger num_vocab_tiling, scan_layers=true, "
            "attention=cudnn_flash, more fsdp or context parallelism, or a smaller per_device_batch_size")


def format_plan(cfg: Config, plan: Plan) -> str:
    m = cfg.model
    gib = lambda b: f"{b / GIB:,.2f} GiB"  # noqa: E731
    return "\n".join([
        f"model: {m.model_name} (quantization={m.quantization or 'bf16'})",
        f"parameters: {plan.parameters:,}",
        _mesh_line(plan),
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
        *_communication_lines(cfg, plan),
    ])


def _mesh_line(plan: Plan) -> str:
    extra = f" x context={plan.context} x tensor={plan.tensor}" if plan.context * plan.tensor > 1 else ""
    return f"mesh: data={plan.data} x fsdp={plan.fsdp}{extra} ({plan.num_devices} devices)"


def _communication_lines(cfg: Config, plan: Plan) -> list[str]:
    comm = plan.communication
    if comm is None or plan.context * plan.tensor == 1:
        return []
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    lines = ["sent per device, decoder layer and step (forward + backward):"]
    if plan.context > 1:
        lines += [
            f"  context ({cfg.model.context_parallel_strategy}): {mib(comm.context)}",
            f"    ulysses {mib(comm.ulysses)} | all_gather {mib(comm.all_gather)} | "
            f"ring attention (for comparison) {mib(comm.ring)}",
        ]
    if plan.tensor > 1:
        lines.append(f"  tensor all-reduces: {mib(comm.tensor)}")
    return lines


def _max_context_line(cfg: Config, num_devices: int, memory: float) -> str:
    length, best = max_context(cfg, num_devices, memory)
    if best is None:
        return (f"max context: none fits ({cfg.model.model_name}, {num_devices} devices of "
                f"{memory / GIB:,.0f} GiB): the state and the shortest sequence do not fit")
    capped = length + _length_block(cfg, num_devices) > config_lib.INT32_MAX
    limit = (f"; the search stops at the trainer's limit, max_target_length <= {config_lib.INT32_MAX:,} "
             "(positions are int32 on the device)") if capped else ""
    return (f"max context: max_target_length={length:,} fits ({best.total_bytes_per_device / GIB:,.1f} GiB "
            f"per device) with global batch {best.global_batch_size}, context={best.context}, "
            f"remat_policy={cfg.model.remat_policy}, attention={best.attention_kernel}{limit}")


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
    parser = CommandParser("plan", error=ConfigError, help=True, description=__doc__.splitlines()[0],
                           epilog=EXIT_CODES)
    parser.add_argument("--num-devices", type=int, default=None,
                        help="devices to plan for (default: the product of the mesh keys, or with a -1 "
                             "mesh key, the devices of this machine)")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="memory of one device (default: the local accelerator's, if any)")
    parser.add_argument("--max-context", action="store_true",
                        help="also print the longest max_target_length that fits the device (needs its memory)")
    parser.add_argument("--project", choices=sorted(projection.DEVICES), default=None,
                        help="also project the step time per recipe on this GPU (docs/backends.md)")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, rest = parser.parse_known_args(argv)
        check_numeric_options(args)
        cfg = load_config(rest)
        num_devices = args.num_devices
        if num_devices is None:
            axes = [getattr(cfg.mesh, key) for key in sharding.MESH_KEYS]
            # With a -1 axis, plan as a run would: for the devices this machine has.
            num_devices = jax.device_count() if -1 in axes else math.prod(axes)
        memory = args.device_memory_gib * GIB if args.device_memory_gib is not None else local_device_memory()
        if memory is not None and not math.isfinite(memory):  # e.g. 1e300 GiB overflows to inf bytes
            raise ConfigError(f"--device-memory-gib={args.device_memory_gib!r} is not allowed: must be a "
                              "positive number of GiB whose bytes are finite "
                              f"(at most {sys.float_info.max / GIB:.3g}).")
        plan = make_plan(cfg, num_devices, memory)
        if args.max_context and memory is None:
            raise ConfigError("--max-context needs the device's memory: give --device-memory-gib "
                              "(no accelerator here says it)")
    except ConfigError as exc:
        return fail(exc, debug=debug_requested(argv))
    print(format_plan(cfg, plan))
    if args.max_context:
        print(_max_context_line(cfg, num_devices, memory))
    if args.project:
        device = projection.DEVICES[args.project]
        estimates = projection.project(cfg.model, device, per_device_batch=cfg.train.per_device_batch_size,
                                       seq_len=cfg.model.max_target_length, num_devices=num_devices)
        print(projection.format_projection(cfg.model, device, estimates))
    return Exit.DOES_NOT_FIT if plan.fits is False else Exit.OK


if __name__ == "__main__":
    sys.exit(main())
