"""Loading a stage's Hydra config: ``configs/<stage>/<preset>.yaml`` plus command-line overrides.

Every stage has one config per preset in ``configs/<stage>/``: ``tiny.yaml`` (the CPU default on
the toy world) and, where the stage has one, ``paper.yaml`` (the paper's numbers on GPUs). Both
are built on ``_base.yaml``, which documents every field and gives each its default, or ``???``
where there is none: a preset states every such value itself (Hydra refuses to run one that does
not) and never inherits another preset's. Shared groups (``configs/tools``, ...) are pulled in
through Hydra defaults lists. Overrides use Hydra's grammar: ``key=value``, ``+new_key=value``,
``~key``.

The resolved form of every preset is committed in ``configs/resolved/<stage>/<preset>.yaml``, so
a reader sees exactly what runs: ``etagent configs`` writes them, ``etagent configs --check``
fails when one is stale (a test runs it).

This uses Hydra's compose API, so stages run as plain functions (no working-directory change,
no ``outputs/`` folders); each stage saves its resolved config in its ``manifest.json``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from omegaconf import MISSING, DictConfig, OmegaConf

from etagent.errors import MissingInput, SettingError, UserError

T = TypeVar("T")


def config_dir() -> Path:
    """The ``configs/`` folder: ``$ETAGENT_CONFIG_DIR`` or the one beside the installed sources."""
    path = Path(os.environ.get("ETAGENT_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))
    if not path.is_dir():
        raise MissingInput(
            f"no configs directory at {path}: install the toolkit from its repository (pip install -e .) or set ETAGENT_CONFIG_DIR"
        )
    return path


def stages() -> list[str]:
    """The config folders (stages and shared groups), ``resolved/`` aside."""
    return sorted(p.name for p in config_dir().iterdir() if p.is_dir() and p.name != "resolved")


def presets(stage: str) -> list[str]:
    """The presets available for a stage (``_base.yaml`` is what they are built on, not a preset)."""
    return sorted(p.stem for p in (config_dir() / stage).glob("*.yaml") if not p.stem.startswith("_"))


@dataclass
class WandbConfig:
    """The ``wandb`` group of the training stages (sft, rl; their _base.yaml documents it)."""

    enabled: bool = MISSING
    mode: str = MISSING
    project: str = MISSING
    run_name: str | None = MISSING


@dataclass
class TensorBoardConfig:
    """The ``tensorboard`` group of the training stages: event files in ``{out_dir}/tensorboard``,
    the logger that needs no account (view them with ``tensorboard --logdir``)."""

    enabled: bool = MISSING


def register_schemas() -> None:
    """The shared groups' dataclasses as Hydra structured configs: each group's ``_base.yaml``
    starts from its ``_schema`` (``defaults: [_schema, _self_]``), so a key the dataclass lacks or
    a value of the wrong type fails at load, naming the key, and :func:`build` makes the object.
    The stages' own schemas are registered by their packages (:func:`register_stage_schema`)."""
    from hydra.core.config_store import ConfigStore

    from etagent.agent import AgentConfig
    from etagent.llm import EngineConfig, OpenAIConfig, Sampling
    from etagent.sampling import RayConfig
    from etagent.tools.executor import ToolsConfig
    from etagent.toy.config import ToyConfig

    store = ConfigStore.instance()
    schemas = {
        "engine": EngineConfig,
        "openai": OpenAIConfig,
        "agent": AgentConfig,
        "tools": ToolsConfig,
        "sampling": Sampling,
        "ray": RayConfig,
    }
    for group, schema in schemas.items():
        store.store(group=group, name="_schema", node=schema)
    register_stage_schema("toy", ToyConfig)


def register_stage_schema(stage: str, schema: type) -> None:
    """A stage's whole config as a dataclass (``<stage>/config.py``), registered as
    ``<stage>/_schema``: each preset starts from it (``defaults: [_schema, ...]``), so every key of
    the stage is a field, and a misspelt or added key (``+train.lerning_rate=1``) or a value of
    the wrong type fails at load, naming the key. The stage's package registers it on import, so
    the core names no stage."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group=stage, name="_schema", node=schema, package="_global_")


def _has_schema(stage: str) -> bool:
    from hydra.core.config_store import ConfigStore

    return "_schema.yaml" in ConfigStore.instance().repo.get(stage, {})


def load_config(stage: str, preset: str = "tiny", overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``configs/<stage>/<preset>.yaml`` with overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    root = config_dir()
    if preset not in presets(stage):
        raise UserError(f"no preset {preset!r} for stage {stage!r} in {root / stage} (have: {', '.join(presets(stage)) or 'none'})")
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    register_schemas()
    if not _has_schema(stage):
        raise UserError(
            f"configs/{stage} has no schema registered: its package registers it when imported "
            f"(register_stage_schema in {stage}/__init__.py); import the stage before loading its config"
        )
    try:
        with initialize_config_dir(config_dir=str(root), version_base=None):
            cfg = compose(config_name=f"{stage}/{preset}", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:  # a misspelt key, a bad override, a wrong type
        # Hydra's own message ("Error merging override x=y") leaves the reason in its cause. Its
        # hint "To append to your config use +key=value" is dropped: the schema refuses that too.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("To append")]
        reason = "; ".join(lines).rstrip(".")
        if isinstance(exc.__cause__, OmegaConfBaseException):
            reason += f": {str(exc.__cause__).splitlines()[0]} (key {exc.__cause__.full_key})"
        raise UserError(f"{root / stage / preset}.yaml with overrides {' '.join(overrides) or '(none)'}: {reason}") from None
    except (AssertionError, AttributeError):  # how OmegaConf fails to set a key in a null group (RL's engine.openai)
        with initialize_config_dir(config_dir=str(root), version_base=None):
            plain = compose(config_name=f"{stage}/{preset}")
        reason = _under_null(plain, overrides)
        if reason is None:  # not the null-group case: a bug, so keep its traceback
            raise
        raise UserError(f"{root / stage / preset}.yaml with overrides {' '.join(overrides)}: {reason}") from None
    added = sorted(_keys_outside_schema(cfg))
    if added:  # Hydra's +key=value adds a key even to a structured group
        raise UserError(
            f"{root / stage / preset}.yaml with overrides {' '.join(overrides) or '(none)'}: "
            f"{', '.join(added)} is not a setting of its group (not a field of its schema)"
        )
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(
            f"{root / stage / preset}.yaml leaves {', '.join(missing)} unset (??? in _base.yaml, no default): "
            "set them in the preset or on the command line"
        )
    return cfg


def _under_null(cfg: DictConfig, overrides: Sequence[str]) -> str | None:
    """Which override sets a key below a setting that is null in ``cfg``, and which setting."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        parts = key.split(".")
        for depth in range(1, len(parts) + 1):
            parent = ".".join(parts[:depth])
            if OmegaConf.select(cfg, parent, default=False) is None and (depth < len(parts) or "={" in override):
                return f"Could not override '{key}': {parent} is null in this stage, not a group of settings it takes"
    return None


def _keys_outside_schema(cfg: DictConfig, path: str = "") -> list[str]:
    """Keys of a structured group (one with a dataclass schema) that the dataclass lacks."""
    from dataclasses import fields, is_dataclass

    from omegaconf import OmegaConf

    keys = []
    schema = OmegaConf.get_type(cfg)
    known = {f.name for f in fields(schema)} if is_dataclass(schema) else None
    for key in cfg.keys():
        if known is not None and key not in known:
            keys.append(f"{path}{key}")
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            keys += _keys_outside_schema(node, f"{path}{key}.")
    return keys


def build(schema: type[T], cfg) -> T:
    """The dataclass ``schema`` made from a config group, nested dataclasses included: the one way
    a config becomes an object. Keys and types are the schema's (OmegaConf refuses an unknown key
    or a value of the wrong type); ranges are each stage's ``check_settings``."""
    from omegaconf import OmegaConf

    if isinstance(cfg, DictConfig):
        # resolved where it sits: ${model} means the stage's model, not a field of the group
        cfg = OmegaConf.to_container(cfg, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))


def parse_stage_args(stage: str, argv: Sequence[str] | None, prog: str, doc: str | None = None) -> DictConfig:
    """The command line of a stage entry point: ``[--preset NAME] [key=value ...]``."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help=f"configs/{stage}/PRESET.yaml (default: tiny)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. key=value")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return load_config(stage, args.preset, args.overrides)


def resolved_yaml(stage: str, preset: str) -> str:
    """What ``--preset PRESET`` runs with no overrides, every interpolation resolved."""
    from omegaconf import OmegaConf

    header = (
        f"# configs/{stage}/{preset}.yaml resolved: what `--preset {preset}` runs without overrides.\n"
        "# Generated by `etagent configs`; do not edit (a test fails when this is stale).\n"
    )
    return header + OmegaConf.to_yaml(load_config(stage, preset), resolve=True)


def write_resolved(check: bool = False) -> list[Path]:
    """Write ``configs/resolved/<stage>/<preset>.yaml`` for every preset (or, with ``check``, only
    compare); returns the files that were (or would be) changed, stale ones removed included."""
    out = config_dir() / "resolved"
    wanted = {out / stage / f"{preset}.yaml": resolved_yaml(stage, preset) for stage in stages() for preset in presets(stage)}
    changed = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    stale = [path for path in out.glob("*/*.yaml") if path not in wanted]
    if not check:
        for path in changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(wanted[path])
        for path in stale:
            path.unlink()
    return sorted(changed + stale)


def configs_main(argv: list[str]) -> int:
    """``etagent configs [--check]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="etagent configs", description="write configs/resolved/ (every preset, resolved)")
    parser.add_argument("--check", action="store_true", help="only report stale files; exit 1 if any")
    args = parser.parse_args(argv)
    changed = write_resolved(check=args.check)
    for path in changed:
        print(
            f"{'stale' if args.check else 'wrote'}: {path.relative_to(config_dir().parent) if path.is_relative_to(config_dir().parent) else path}"
        )
    if args.check and changed:
        print("run `etagent configs` to rewrite them", flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# Checking settings before work starts. Each stage's ``check_settings`` calls these for the keys
# it reads, so a count of 0, a learning rate of "fast" or a model path that does not exist is
# refused at start, naming the key, instead of failing (or silently doing nothing) later.


def placed(cfg: DictConfig, prefix: str) -> DictConfig:
    """A config holding ``cfg`` at the dotted ``prefix`` (``editor.engine``), so a shared group's
    checks name its keys as the stage's config spells them."""
    from omegaconf import OmegaConf

    root = OmegaConf.create({})
    OmegaConf.update(root, prefix, cfg, force_add=True)
    return root


def _value(cfg: DictConfig, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, throw_on_missing=True)


def require_int(cfg: DictConfig, key: str, minimum: int = 1, *, optional: bool = False) -> int | None:
    """``key`` is an integer >= minimum (or null, when ``optional``)."""
    value = _value(cfg, key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        null = " or null" if optional else ""
        raise SettingError(key, f"must be an integer >= {minimum}{null}, got {value!r}")
    return value


def require_number(
    cfg: DictConfig, key: str, minimum: float | None = None, maximum: float | None = None, *, above: float | None = None
) -> float:
    """``key`` is a number in [minimum, maximum], or > above."""
    value = _value(cfg, key)
    bounds = [
        f">= {minimum}" if minimum is not None else "",
        f"> {above}" if above is not None else "",
        f"<= {maximum}" if maximum is not None else "",
    ]
    wanted = "a number " + " and ".join(b for b in bounds if b) if any(bounds) else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingError(key, f"must be {wanted}, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum) or (above is not None and value <= above):
        raise SettingError(key, f"must be {wanted}, got {value!r}")
    return float(value)


def require_choice(cfg: DictConfig, key: str, choices: Sequence[str]) -> str:
    value = _value(cfg, key)
    if value not in choices:
        raise SettingError(key, f"must be one of {', '.join(map(str, choices))}, got {value!r}")
    return value


def require_file(cfg: DictConfig, key: str) -> Path:
    """``key`` names an existing file (or directory, for a parquet dataset)."""
    value = _value(cfg, key)
    if not value or not Path(value).exists():
        raise SettingError(key, f"no file at {value!r}")
    return Path(value)


def require_model(cfg: DictConfig, key: str) -> str:
    """``key`` names a model: a local directory with config.json, or a Hugging Face repo id
    (``org/name``) for machines that may download. A value that reads as a local path (it starts
    with ``/`` or ``.``, has more than one ``/``, or its first part is a local directory, as
    ``runs/toy/model`` is) must exist, so a typo is refused here rather than inside transformers
    with a message about repo ids, and before any output is written."""
    value = _value(cfg, key)
    if isinstance(value, str) and (Path(value) / "config.json").is_file():
        return value
    parts = str(value).split("/") if value else []
    hub_id = len(parts) == 2 and all(parts) and not str(value).startswith((".", "/")) and not Path(parts[0]).is_dir()
    if not hub_id:
        raise SettingError(
            key,
            f"no model at {value!r} (a directory with config.json); build the toy model with `etagent toy build` "
            "or give the path of a local checkpoint",
        )
    return value
