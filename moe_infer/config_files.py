"""Configs from files and mappings: YAML configs, the built-in presets (``configs/``) and
the sections of a mapping (a YAML document, or what ``moe_infer.hf`` reads from a Hugging
Face ``config.json``), each key checked against its field's type with one line on error."""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path

import yaml

from moe_infer.config import Config, ConfigError, EngineConfig, ModelConfig, MoEConfig, ParallelConfig, _fail


def _convert(key: str, value, annotation):
    """Checks ``value`` against a field's type annotation; returns the converted value."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(key, value, inner[0])
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            _fail(key, value, "a list")
        return tuple(_convert(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if annotation is bool:
        if not isinstance(value, bool):
            _fail(key, value, "true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, value, "an integer")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(key, value, "a number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            _fail(key, value, "a string")
        return value
    if dataclasses.is_dataclass(annotation):
        return section_from_dict(annotation, value, key)
    raise TypeError(f"unsupported annotation {annotation!r} for {key}")


def section_from_dict(cls, data, section: str):
    """Builds dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        _fail(section, data, "a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = ([f for f in fields if f.startswith(str(key))]
                     or difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5))
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{section}.{key}={data[key]!r}: unknown key{hint}; "
                              f"expected one of {', '.join(fields)}")
    missing = [n for n, f in fields.items() if n not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        _fail(f"{section}.{missing[0]}", "<missing>", "a value (this key is required)")
    kwargs = {k: _convert(f"{section}.{k}", v, hints[k]) for k, v in data.items()}
    return cls(**kwargs)


_SECTIONS = {"model": ModelConfig, "moe": MoEConfig, "parallel": ParallelConfig,
             "engine": EngineConfig}


def config_from_dict(data: dict, source: str = "config") -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with a 'model' section, got {type(data).__name__}")
    known = set(_SECTIONS) | {"name", "checkpoint"}
    for key in data:
        if key not in known:
            _fail(str(key), data[key], f"a top-level key among {', '.join(sorted(known))}")
    if "model" not in data and "checkpoint" not in data:
        raise ConfigError(f"{source}: expected a 'model' section or a 'checkpoint' path")
    kwargs = {}
    if data.get("parallel") == "auto":  # chosen at load, for the job's ranks
        data = {k: v for k, v in data.items() if k != "parallel"}
        kwargs["parallel_auto"] = True
    for key, cls in _SECTIONS.items():
        if data.get(key) is not None:
            kwargs[key] = section_from_dict(cls, data[key], key)
    for key in ("name", "checkpoint"):
        if data.get(key) is not None:
            kwargs[key] = _convert(key, data[key], str)
    if "model" not in kwargs:
        # Only a checkpoint path: the model comes from its config.json.
        from moe_infer.hf import read_hf_config

        base = read_hf_config(_resolve_checkpoint(kwargs["checkpoint"], source))
        kwargs["model"], kwargs["moe"] = base.model, kwargs.get("moe", base.moe)
    return Config(**kwargs)


DEFAULT_MODEL = Path(__file__).resolve().parent / "default_model"


def _resolve_checkpoint(path: str, source: str) -> str:
    """``default`` names the embedded model; a relative path is relative to the YAML file."""
    if path == "default":
        return str(DEFAULT_MODEL)
    p = Path(path).expanduser()
    if not p.is_absolute() and Path(source).is_file():
        p = Path(source).parent / p
    return str(p)


def load_yaml_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    cfg = config_from_dict(data, str(path))
    if cfg.checkpoint is not None:
        cfg.checkpoint = _resolve_checkpoint(cfg.checkpoint, str(path))
    return cfg


def configs_dir() -> Path:
    """The preset YAML files: ``configs/`` in a source tree, else the installed copy."""
    tree = Path(__file__).resolve().parent.parent / "configs"
    if tree.is_dir():
        return tree
    from importlib import resources

    return Path(str(resources.files("moe_infer.configs")))


def preset_names() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yaml"))


def load_preset(name: str) -> Config:
    path = configs_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"preset {name!r}: no such built-in config; known: {', '.join(preset_names())}")
    return load_yaml_config(path)
