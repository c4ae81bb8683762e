"""A validated `Config` from layers of keys (presets, YAML, key=value), and back to JSON."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from nvfp4_jax.config.errors import ConfigError
from nvfp4_jax.config.overrides import coerce, field_types, parse_overrides, resolve_key
from nvfp4_jax.config.presets import MODEL_PRESETS
from nvfp4_jax.config.schema import SECTION_CLASSES, Config, ModelConfig
from nvfp4_jax.config.validate import validate
from nvfp4_jax.config.yaml_file import load_yaml


def make_config(*layers: Mapping[str, Any]) -> Config:
    """Builds a validated Config from override layers applied in order (later layers win).

    The model preset named by the final `model_name` is applied first, under all layers.
    """
    merged: dict[tuple[str, str], Any] = {}
    for layer in layers:
        for key, value in layer.items():
            merged[resolve_key(key)] = value
    model_name = str(merged.get(("model", "model_name"), ModelConfig.model_name))
    if model_name not in MODEL_PRESETS:
        raise ConfigError(
            f"model_name={model_name!r} is not a known preset; choose one of {sorted(MODEL_PRESETS)}."
        )
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTION_CLASSES}
    values["model"].update(MODEL_PRESETS[model_name])
    for (section, name), value in merged.items():
        values[section][name] = value
    sections = {}
    for section, cls in SECTION_CLASSES.items():
        types = field_types(cls)
        sections[section] = cls(**{k: coerce(k, v, types[k]) for k, v in values[section].items()})
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def config_layers(argv: Sequence[str] = ()) -> list[Mapping[str, Any]]:
    """`[config.yml] [key=value ...]` -> the layers `make_config` applies (YAML, then overrides)."""
    argv = list(argv)
    layers: list[Mapping[str, Any]] = []
    if argv and "=" not in argv[0]:
        layers.append(load_yaml(argv.pop(0)))
    layers.append(parse_overrides(argv))
    return layers


def load_config(argv: Sequence[str] = ()) -> Config:
    """`[config.yml] [key=value ...]` -> Config (the command-line form)."""
    return make_config(*config_layers(argv))


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def save_json(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_dict(cfg), f, indent=2, sort_keys=True)


def from_dict(data: Mapping[str, Mapping[str, Any]]) -> Config:
    """Inverse of `to_dict` (reads a saved config.json)."""
    flat = {f"{section}.{k}": v for section, keys in data.items() for k, v in keys.items()}
    return make_config(flat)
