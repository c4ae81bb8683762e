"""Arms of a study: a name and the config keys it changes, written `name:key=value,key=value`.

An arm whose name is a quantization flag (`te_nvfp4`, `mxfp4`, ...) and that sets no
`quantization` of its own trains with that flag; any other arm keeps the base config's
quantization unless it sets one. `quantization_end_step` may be given as a percentage of
`steps` (`quantization_end_step=80%`). The lab owns `seed`, `run_name` and
`base_output_directory`; an arm may not set them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

from nvfp4_jax.config import QUANTIZATION_FLAGS, Config, ConfigError, make_config

# The NVFP4 paper's comparisons (arXiv 2509.25149), in the command-line form.
DEFAULT_ARMS = (
    "bf16",
    "te_fp8_delayedscaling",
    "te_nvfp4",
    "te_nvfp4_no_rht",
    "nvfp4_no_sr",
    "nvfp4_1d_weights",
    "mxfp4",
    "mxfp4_nvfp4_recipe",
    "te_nvfp4_bf16_ends:quantization=te_nvfp4,bf16_first_layers=1,bf16_last_layers=1",
    "te_nvfp4_bf16_tail:quantization=te_nvfp4,quantization_end_step=80%",
)
LAB_KEYS = ("seed", "run_name", "base_output_directory")
# Defaults the lab applies under the base config (which may override them): evaluate every run
# through its recipe's forward pass and through BF16.
LAB_DEFAULTS: Mapping[str, Any] = {"eval_quantization": "both"}
# Keys whose value may be a percentage of `steps`.
STEP_KEYS = ("quantization_end_step",)
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: `name` (also its run directories' prefix) and its config overrides."""

    name: str
    overrides: tuple[tuple[str, str], ...] = ()

    @property
    def spec(self) -> str:
        """The command-line form `name:key=value,...`."""
        keys = ",".join(f"{k}={v}" for k, v in self.overrides)
        return f"{self.name}:{keys}" if keys else self.name


def parse_arm(text: str) -> Arm:
    """`name` or `name:key=value,key=value` -> Arm; a malformed spec is a ConfigError."""
    name, _, rest = text.strip().partition(":")
    if not _NAME.fullmatch(name):
        raise ConfigError(f"arm {text!r}: the name {name!r} must match [A-Za-z0-9_.-]+ (it names directories).")
    overrides: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"arm {text!r}: expected key=value, got {item!r}.")
        key = key.strip().split(".")[-1]
        if key in LAB_KEYS:
            raise ConfigError(f"arm {text!r}: {key} is set by the lab for every arm; remove it.")
        overrides.append((key, value.strip()))
    keys = [k for k, _ in overrides]
    duplicated = sorted({k for k in keys if keys.count(k) > 1})
    if duplicated:
        raise ConfigError(f"arm {text!r}: {', '.join(duplicated)} given more than once.")
    return Arm(name, tuple(overrides))


def parse_arms(texts: Sequence[str]) -> list[Arm]:
    """Parses every spec; arm names must be unique."""
    arms = [parse_arm(t) for t in texts]
    names = [a.name for a in arms]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ConfigError(f"arm names must be unique; repeated: {', '.join(duplicated)}.")
    if not arms:
        raise ConfigError("a study needs at least one arm.")
    return arms


def _resolve_percentages(overrides: dict[str, str], steps: int, arm: Arm) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if isinstance(value, str) and value.endswith("%"):
            if key not in STEP_KEYS:
                raise ConfigError(f"arm {arm.spec!r}: {key}={value}: only {', '.join(STEP_KEYS)} take a percentage.")
            try:
                fraction = float(value[:-1]) / 100.0
            except ValueError:
                raise ConfigError(f"arm {arm.spec!r}: {key}={value} is not a percentage.") from None
            out[key] = round(steps * fraction)
        else:
            out[key] = value
    return out


def arm_config(base: Sequence[Mapping[str, Any]], arm: Arm, seed: int, runs_dir: str, *,
               extend: float = 1.0) -> Config:
    """The validated config of `arm` with `seed`: the lab's defaults (`LAB_DEFAULTS`), base
    layers, the arm's keys, then the lab's own (seed, run_name `<arm>-seed<seed>`,
    base_output_directory `runs_dir`).

    `extend` > 1 is the arm's longer run for tokens-to-target (`<arm>-x<extend>-seed<seed>`):
    `extend` times the steps, percentages of steps taken of the study's steps (a BF16 tail
    still starts where the study's run switches)."""
    overrides = dict(arm.overrides)
    if "quantization" not in overrides and arm.name in QUANTIZATION_FLAGS:
        overrides["quantization"] = arm.name
    layers = [LAB_DEFAULTS, *base]
    plain = {k: v for k, v in overrides.items() if not str(v).endswith("%")}
    steps = make_config(*layers, plain).train.steps
    name = f"{arm.name}-seed{seed}" if extend == 1.0 else f"{arm.name}-x{extend:g}-seed{seed}"
    lab = {"seed": seed, "run_name": name, "base_output_directory": runs_dir}
    if extend != 1.0:
        lab["steps"] = round(steps * extend)
    return make_config(*layers, _resolve_percentages(overrides, steps, arm), lab)
