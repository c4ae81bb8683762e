"""`python -m nvfp4_jax.plan [config.yml] [key=value ...] [--num-devices N]`: size a run on paper.

Builds the model abstractly (`jax.eval_shape`: nothing is allocated, so 405B plans on a laptop),
then prints the parameter count, per-device memory under the configured mesh, and the model
FLOPs per step that the TFLOP/s/device metric uses.

Memory model (per device, no rematerialisation): parameters fp32 and their gradients fp32, both
FSDP-sharded like the parameters; AdamW's two fp32 moments, sharded the same way; activations saved
for the backward pass, in the compute dtype, for this device's share of the batch:
per token and decoder layer, the inputs of every projection and of SwiGLU's product
(`4*D + 2*G*K + H*K + 3*F` values), plus the fp32 attention probabilities (`H*L` per token), plus
the fp32 logits (`V` per token). It is an estimate of what XLA keeps, good to a small factor.
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
from nvfp4_jax.config import Config, ConfigError, load_config

GIB = 1024**3


@dataclass(frozen=True)
class Plan:
    parameters: int
    num_devices: int
    data: int
    fsdp: int
    parameter_bytes_per_device: float
    gradient_bytes_per_device: float
    optimizer_bytes_per_device: float
    activation_bytes_per_device: float
    flops_per_step: float
    global_batch_size: int

    @property
    def total_bytes_per_device(self) -> float:
        return (self.parameter_bytes_per_device + self.gradient_bytes_per_device
                + self.optimizer_bytes_per_device + self.activation_bytes_per_device)


def _shard_elements(shape, names, mesh_sizes) -> float:
    """Elements of one device's shard of an array with logical axis `names`."""
    rules = dict(sharding.LOGICAL_AXIS_RULES)
    count = 1.0
    for dim, name in zip(shape, names or (None,) * len(shape)):
        mesh_axes = rules.get(name) if name else None
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
        count *= math.ceil(dim / math.prod(mesh_sizes[a] for a in mesh_axes))
    return count


def make_plan(cfg: Config, num_devices: int) -> Plan:
    from nvfp4_jax.train.build import build_model

    data, fsdp = sharding.mesh_shape(cfg.mesh, num_devices)
    m = cfg.model
    model = build_model(m, quantized=False)
    tokens = jax.ShapeDtypeStruct((1, min(m.max_target_length, 16)), jnp.int32)
    boxed = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t), tokens)["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    sizes = {"data": data, "fsdp": fsdp}
    parameters = sum(math.prod(leaf.value.shape) for leaf in leaves)
    shard = sum(_shard_elements(leaf.value.shape, leaf.names, sizes) for leaf in leaves)
    per_device_batch = cfg.train.per_device_batch_size
    L = m.max_target_length
    act_bytes = 2 if m.dtype == "bfloat16" else 4
    per_token_layer = (4 * m.base_emb_dim + 2 * m.base_num_kv_heads * m.head_dim
                       + m.base_num_query_heads * m.head_dim + 3 * m.base_mlp_dim) * act_bytes
    per_token_layer += 4 * m.base_num_query_heads * L
    activations = per_device_batch * L * (per_token_layer * m.base_num_decoder_layers + 4 * m.vocab_size)
    global_batch = per_device_batch * num_devices
    return Plan(
        parameters=parameters,
        num_devices=num_devices,
        data=data,
        fsdp=fsdp,
        parameter_bytes_per_device=4 * shard,
        gradient_bytes_per_device=4 * shard,
        optimizer_bytes_per_device=8 * shard,
        activation_bytes_per_device=float(activations),
        flops_per_step=flops.training_flops_per_step(m, global_batch, L),
        global_batch_size=global_batch,
    )


def format_plan(cfg: Config, plan: Plan) -> str:
    gib = lambda b: f"{b / GIB:,.2f} GiB"  # noqa: E731
    return "\n".join([
        f"model: {cfg.model.model_name} (quantization={cfg.model.quantization or 'bf16'})",
        f"parameters: {plan.parameters:,}",
        f"mesh: data={plan.data} x fsdp={plan.fsdp} ({plan.num_devices} devices)",
        f"global batch: {plan.global_batch_size} x {cfg.model.max_target_length} tokens",
        "per-device memory:",
        f"  parameters (fp32):       {gib(plan.parameter_bytes_per_device)}",
        f"  gradients (fp32):        {gib(plan.gradient_bytes_per_device)}",
        f"  optimizer (AdamW, fp32): {gib(plan.optimizer_bytes_per_device)}",
        f"  activations (estimate):  {gib(plan.activation_bytes_per_device)}",
        f"  total (estimate):        {gib(plan.total_bytes_per_device)}",
        f"model FLOPs per step: {plan.flops_per_step:.4e} "
        f"({plan.flops_per_step / plan.num_devices / 1e12:,.1f} TFLOP per device)",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvfp4_jax.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--num-devices", type=int, default=None,
                        help="devices to plan for (default: the product of the mesh keys)")
    parser.add_argument("--project", choices=sorted(projection.DEVICES), default=None,
                        help="also project the step time per recipe on this GPU (docs/backends.md)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(rest)
        num_devices = args.num_devices
        if num_devices is None:
            axes = (cfg.mesh.dcn_data_parallelism, cfg.mesh.ici_data_parallelism, cfg.mesh.ici_fsdp_parallelism)
            if -1 in axes:
                raise ConfigError(
                    "The plan needs a device count: give --num-devices N, or set every mesh key "
                    "(ici_fsdp_parallelism, ici_data_parallelism, dcn_data_parallelism) to a positive size."
                )
            num_devices = math.prod(axes)
        plan = make_plan(cfg, num_devices)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(cfg, plan))
    if args.project:
        device = projection.DEVICES[args.project]
        estimates = projection.project(cfg.model, device, per_device_batch=cfg.train.per_device_batch_size,
                                       seq_len=cfg.model.max_target_length, num_devices=num_devices)
        print(projection.format_projection(cfg.model, device, estimates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
