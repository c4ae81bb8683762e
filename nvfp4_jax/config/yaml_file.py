"""A YAML config file as a mapping of key: value, each key once; every problem a ConfigError."""

from __future__ import annotations

import os
from typing import Any

import yaml

from nvfp4_jax.config.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML lets a repeated key overwrite the first silently; a config must say each key once."""

    def construct_mapping(self, node, deep=False):
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key == "<<" or not isinstance(key, (str, int, float, bool)):
                continue  # merge keys and odd keys: PyYAML's own rules and errors apply
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise _DuplicateKey(f"the key {key!r} appears twice (lines {first_line[key]} and {line}); "
                                    "give each key once")
            first_line[key] = line
        return super().construct_mapping(node, deep)


class _DuplicateKey(Exception):
    pass


def load_yaml(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise ConfigError(f"Config file {path!r} does not exist.")
    if os.path.isdir(path):
        raise ConfigError(f"Config file {path!r} is a directory; give a .yml file.")
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as exc:
        raise ConfigError(f"Config file {path!r}: {exc}.") from None
    except OSError as exc:
        raise ConfigError(f"Config file {path!r} cannot be read: {exc.strerror}.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"Config file {path!r} is not UTF-8 text.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"Config file {path!r} is not valid YAML{where}: {problem}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path!r} must hold a mapping of key: value, got {type(data).__name__}.")
    return data
