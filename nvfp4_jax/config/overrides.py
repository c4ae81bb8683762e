"""Key=value text into typed config values: key resolution (with the closest valid key), value
coercion to each field's type, and the command line's `key=value` pairs."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Sequence

from nvfp4_jax.config.errors import ConfigError
from nvfp4_jax.config.schema import KEY_SECTIONS, SECTION_CLASSES


def _closest(key: str, options) -> str:
    match = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


@functools.lru_cache(maxsize=None)  # a section class's fields never change
def field_types(cls) -> dict[str, type]:
    """Each field's value type; a field typed with its choices (a `Literal`) takes their type."""
    hints = typing.get_type_hints(cls)
    return {f.name: _value_type(hints[f.name]) for f in dataclasses.fields(cls)}


def _value_type(hint) -> type:
    if typing.get_origin(hint) is typing.Literal:
        (typ,) = {type(choice) for choice in typing.get_args(hint)}
        return typ
    return hint


def coerce(key: str, value: Any, typ: type) -> Any:
    """Turns a YAML or command-line value into the field's type, or raises ConfigError."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise ConfigError(f"{key}={value!r}: expected a boolean (true/false).")
    if typ is str:
        return "" if value is None else str(value)
    try:
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            if isinstance(value, str) and any(c in value for c in ".eE") and "x" not in value:
                as_float = float(value)
                if not as_float.is_integer():
                    raise ValueError
                return int(as_float)
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: expected {typ.__name__}.") from None


def resolve_key(key: str) -> tuple[str, str]:
    if not isinstance(key, str):
        raise ConfigError(f"Config key {key!r} must be a name such as steps or learning_rate.")
    if "." in key:
        section, name = key.split(".", 1)
        if section not in SECTION_CLASSES:
            raise ConfigError(
                f"Unknown config section '{section}' in '{key}'; sections: {sorted(SECTION_CLASSES)}."
            )
        if KEY_SECTIONS.get(name) != section:
            raise ConfigError(
                f"Unknown config key '{key}'.{_closest(name, [k for k, s in KEY_SECTIONS.items() if s == section])}"
            )
        return section, name
    if key not in KEY_SECTIONS:
        raise ConfigError(f"Unknown config key '{key}'.{_closest(key, KEY_SECTIONS)}")
    return KEY_SECTIONS[key], key


def parse_overrides(args: Sequence[str]) -> dict[str, str]:
    """`["a=1", "b=x"]` -> `{"a": "1", "b": "x"}`; anything else is an error."""
    out: dict[str, str] = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"Expected key=value, got {arg!r}.")
        key, value = arg.split("=", 1)
        out[key.strip()] = value.strip()
    return out
