"""One run, assembled once: the start-up decisions (`Startup`) and what is built from them (`Run`).

Every program that trains, evaluates or restores a model (the trainer, federated sites and the
server's evaluator, `sample`, `convert`) calls `assemble(cfg, devices)` instead of writing the
"mesh -> decisions -> model -> optimizer -> abstract state -> jitted steps" wiring out again:

    run = assemble(cfg)                      # decides everything once, compiles nothing
    state = run.init_state()                 # or checkpoint.restore(..., run.abstract_state)
    state, metrics = run.train_step(state, run.put(dataset.batch(0)))

The steps are jitted on first use (each a `functools.cached_property`): a program that only
restores parameters never traces a train step, and the BF16 tail's step and the BF16 evaluation
are built only by a run that reaches them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import optax

from nvfp4_jax import data as data_lib
from nvfp4_jax import quant, sharding
from nvfp4_jax.config import Config, MeshConfig
from nvfp4_jax.model import lora, select_attention
from nvfp4_jax.train import build
from nvfp4_jax.train.optimizer import make_optimizer


@dataclasses.dataclass(frozen=True)
class Startup:
    """Every start-up decision of a run, resolved once from (config, devices), with its reason.
    The start-up lines come from it (`lines`), checkpoints record it (`record`), a resume
    compares the saved record with this one (`changes_from`)."""

    mlp_recipe: str  # the MLP GEMMs' recipe ("bf16": none)
    backend: quant.Backend  # who runs the MLP GEMMs (name, reason, executor, operand kernels)
    attention_kernel: str
    attention_reason: str
    attention_projections: str  # the attention projections' GEMM recipe ("bf16" or an FP8 recipe)
    kernel_dtype: str | None  # what a kernel is quantized from: the compute-dtype copy, or None (fp32)
    bf16_from_step: int | None  # the BF16 tail's first step (quantization_end_step), or None
    mesh_shape: dict[str, int]
    global_batch: int | None  # None for a program that never trains (e.g. `convert`)
    # What the optimizer trains: "all" parameters, or "adapters" (LoRA, the backbone frozen).
    trained_params: str = "all"
    adapter_line: str = ""  # the adapters' rank and targets, printed when they are trained alone

    @property
    def quantizes_anything(self) -> bool:
        """Whether any GEMM of the model is quantized (else the model is its own BF16 forward)."""
        return self.mlp_recipe != "bf16" or self.attention_projections != "bf16"

    def lines(self) -> list[str]:
        """The start-up lines, in the order the trainer prints them."""
        lines = [f"attention: {self.attention_kernel} ({self.attention_reason})", self.backend.line]
        if self.backend.operands is not None:
            lines.append(f"NVFP4 operands: {self.backend.operands}")
        if self.trained_params == "adapters":
            lines.append(f"trains: the LoRA adapters alone ({self.adapter_line}); the backbone is frozen")
        return lines

    def record(self) -> dict[str, Any]:
        """The decisions as JSON (a checkpoint's record keeps them)."""
        return {
            "mlp_recipe": self.mlp_recipe, "quantization_backend": self.backend.name,
            "operand_kernels": self.backend.operands, "kernel_dtype": self.kernel_dtype,
            "attention_kernel": self.attention_kernel, "attention_projections": self.attention_projections,
            "bf16_from_step": self.bf16_from_step, "mesh": dict(self.mesh_shape),
            "global_batch_size": self.global_batch, "trained_params": self.trained_params,
        }

    def changes_from(self, saved: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
        """(decision, saved value, this value) for each decision a saved `record()` made
        differently (an older checkpoint without a record: none)."""
        if not isinstance(saved, dict):
            return []
        now = self.record()
        return [(key, saved[key], now[key]) for key in now if key in saved and saved[key] != now[key]]


def resolve_startup(cfg: Config, mesh, *, trains: bool = True) -> Startup:
    """The start-up decisions of `cfg` on `mesh` (it may compile a tiny probe for the backend);
    `trains=False`: a program that never trains, so no global batch."""
    m, t = cfg.model, cfg.train
    attention = select_attention(m.attention, seq_len=m.max_target_length)
    return Startup(
        mlp_recipe=m.quantization or "bf16",
        backend=build.quantization_backend(m),
        attention_kernel=attention.kernel,
        attention_reason=attention.reason,
        attention_projections=quant.recipe_name(m.attention_recipe),
        # MaxText casts the fp32 kernel to the compute dtype before its dot and TE quantizes that
        # copy; quantize_fp32_kernel=true quantizes the master kernel instead.
        kernel_dtype=None if m.quantize_fp32_kernel else m.dtype,
        bf16_from_step=t.quantization_end_step if t.quantization_end_step >= 0 else None,
        mesh_shape={axis: int(size) for axis, size in mesh.shape.items()},
        global_batch=sharding.global_batch_size(t.per_device_batch_size, mesh.devices.size) if trains else None,
        trained_params="adapters" if lora.trains_adapters_only(m, t) else "all",
        adapter_line=(f"rank {m.lora_rank}, alpha {m.lora_alpha:g}, on {m.lora_targets}" if m.lora_rank else ""),
    )


class Run:
    """The objects of one run, built from its config and start-up decisions: mesh, model,
    optimizer, abstract state and shardings, state init, batch placement and the jitted steps."""

    def __init__(self, cfg: Config, mesh, startup: Startup, optimizer: optax.GradientTransformation, *,
                 model=None):
        """`model` replaces the model of `cfg` (a benchmark's stand-in of the same parameters)."""
        self.cfg, self.mesh, self.startup = cfg, mesh, startup
        self.adapters_only = startup.trained_params == "adapters"
        # A frozen backbone: whatever optimizer is given updates (and holds state for) the adapters.
        self._given_optimizer = optimizer
        self.optimizer = lora.freeze_backbone(optimizer) if self.adapters_only else optimizer
        self.model = self._model(quantized=True) if model is None else model
        self.batch_sharding = sharding.batch_sharding(mesh)

    def _model(self, *, quantized: bool, quant_stats: bool = False):
        return build.build_model(self.cfg.model, quantized=quantized, backend=self.startup.backend,
                                 quant_stats=quant_stats, attention_kernel=self.startup.attention_kernel)

    def with_optimizer(self, optimizer: optax.GradientTransformation) -> "Run":
        """The same run (decisions, mesh, model) with another optimizer (e.g. a frozen backbone's)."""
        return Run(self.cfg, self.mesh, self.startup, optimizer, model=self.model)

    @property
    def base_optimizer(self) -> optax.GradientTransformation:
        """The optimizer as given, before a frozen backbone restricts it to the adapters."""
        return self._given_optimizer

    @property
    def global_batch(self) -> int:
        return self.startup.global_batch

    @property
    def seq_len(self) -> int:
        return self.cfg.model.max_target_length

    @functools.cached_property
    def _abstract(self):
        return build.state_shardings(self.model, self.optimizer, self.seq_len, self.mesh)

    @property
    def abstract_state(self):
        """The state's shapes and dtypes with their shardings: what a checkpoint restores onto."""
        return self._abstract[0]

    @property
    def state_shardings(self):
        return self._abstract[1]

    def init_state(self, seed: int | None = None):
        """A freshly initialised state, sharded as `state_shardings` (seed: `train.seed`)."""
        seed = self.cfg.train.seed if seed is None else seed
        return build.init_sharded(self.model, self.optimizer, self.seq_len, self.state_shardings, seed)

    def dataset(self, split: str):
        """The run's `split` ("train" or "eval") data, batched to the global batch."""
        m = self.cfg.model
        image_shape = (m.image_size, m.image_size, m.image_channels) if m.model_type == "vlm" else None
        return data_lib.make_dataset(self.cfg.data, seq_len=m.text_length, global_batch_size=self.global_batch,
                                     seed=self.cfg.train.seed, split=split, vocab_size=m.vocab_size,
                                     image_shape=image_shape)

    def put(self, local_batch: dict) -> dict:
        """This process's rows of a global batch, assembled into sharded arrays."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local_batch.items()}

    @functools.cached_property
    def train_step(self):
        return build.jit_train_step(self.model, self.optimizer, self.mesh, self.state_shardings,
                                    adapters_only=self.adapters_only)

    @functools.cached_property
    def bf16_model(self):
        """The model with the same parameters and BF16 dots (the BF16 tail's, a BF16 evaluation's)."""
        return self._model(quantized=False)

    @functools.cached_property
    def bf16_train_step(self):
        """The BF16 tail's step (`quantization_end_step`): the same parameters with BF16 dots."""
        return build.jit_train_step(self.bf16_model, self.optimizer, self.mesh, self.state_shardings,
                                    uses_fp8_meta=False, adapters_only=self.adapters_only)

    @functools.cached_property
    def eval_step(self):
        return build.jit_eval_step(self.model, self.mesh, self.state_shardings)

    @functools.cached_property
    def bf16_eval_step(self):
        """The eval step of the same parameters with BF16 dots (a BF16 run's own eval step)."""
        if not self.startup.quantizes_anything:
            return self.eval_step
        return build.jit_eval_step(self.bf16_model, self.mesh, self.state_shardings)

    @functools.cached_property
    def quant_stats_step(self):
        """The quantization-statistics step, or None when no GEMM is quantized."""
        return build.jit_quant_stats_step(self.cfg.model, self.mesh, self.state_shardings,
                                          backend=self.startup.backend,
                                          attention_kernel=self.startup.attention_kernel)


def assemble(cfg: Config, devices: Sequence[jax.Device] | None = None, *,
             optimizer: optax.GradientTransformation | None = None, mesh_config: MeshConfig | None = None,
             check_batch: bool = True) -> Run:
    """The run of `cfg` on `devices` (default: all): its mesh (`cfg.mesh`, or `mesh_config` for a
    program that only restores, such as `convert`, on a mesh of its own), the start-up decisions,
    and the objects built from them. `check_batch=False` skips the batch-size checks for a
    program that never trains."""
    mesh = sharding.make_mesh(mesh_config or cfg.mesh, devices)
    if check_batch:
        sharding.check_divisibility(cfg, mesh)
    return Run(cfg, mesh, resolve_startup(cfg, mesh, trains=check_batch), optimizer or make_optimizer(cfg.train))
