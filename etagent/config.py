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
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, TypeVar

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from etagent.errors import MissingInput, SettingError, UserError
from etagent.settings import FREE, Ge, Lt, OneOf, PositiveInt, group, validate

T = TypeVar("T")


def config_dir() -> Path:
    """The ``configs/`` folder: ``$ETAGENT_CONFIG_DIR``, or the package's ``etagent/configs`` (in the
    repository a link to its ``configs/``; in an installed wheel a copy of it)."""
    path = Path(os.environ.get("ETAGENT_CONFIG_DIR", (Path(__file__).resolve().parent / "configs").resolve()))
    if not path.is_dir():
        raise MissingInput(f"no configs directory at {path}: reinstall the toolkit, or set ETAGENT_CONFIG_DIR to a configs folder")
    return path


def stages() -> list[str]:
    """The config folders (stages and shared groups), ``resolved/`` aside."""
    return sorted(p.name for p in config_dir().iterdir() if p.is_dir() and p.name != "resolved")


def presets(stage: str) -> list[str]:
    """The presets available for a stage (``_base.yaml`` is what they are built on, not a preset)."""
    return sorted(p.stem for p in (config_dir() / stage).glob("*.yaml") if not p.stem.startswith("_"))


@group
class WandbConfig:
    """The ``wandb`` group of the training stages (sft, rl; their _base.yaml documents it): how a
    run is logged, never what it computes, so a resumed run may change it."""

    enabled: Annotated[bool, FREE] = MISSING
    mode: Annotated[str, OneOf("offline", "online", "disabled"), FREE] = MISSING
    project: Annotated[str, FREE] = MISSING
    run_name: Annotated[str | None, FREE] = MISSING


@group
class TensorBoardConfig:
    """The ``tensorboard`` group of the training stages: event files in ``{out_dir}/tensorboard``,
    the logger that needs no account (view them with ``tensorboard --logdir``)."""

    enabled: Annotated[bool, FREE] = MISSING


@group
class LoraSettings:
    """The ``lora`` group of the training stages (sft, rl): low-rank adapters (peft's LoRA) on
    ``target_modules`` instead of training every weight; each stage's _base.yaml says what it
    saves."""

    enabled: bool = MISSING
    rank: PositiveInt = MISSING
    alpha: PositiveInt = MISSING
    dropout: Annotated[float, Ge(0), Lt(1)] = MISSING
    target_modules: list[str] = MISSING

    def peft_config(self):
        """These settings as peft's ``LoraConfig`` for a causal LM."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            task_type="CAUSAL_LM",
        )

    def check_targets(self, model: str) -> None:
        """Before the model loads: every name in ``target_modules`` names a layer of ``model``
        (a module called that, or ending in ``.<name>``: peft's match), and peft can put adapters
        on all of them (its own injection, into the model built on the meta device). A model
        given as a hub id or a .gguf file is not read here."""
        from peft import inject_adapter_in_model
        from torch import nn

        from etagent.settings import is_hub_id, model_on_meta

        if not self.target_modules:
            raise SettingError("lora.target_modules", "is empty: name the layers to adapt, e.g. [q_proj, k_proj, v_proj, o_proj]")
        if is_hub_id(model) or not Path(model).is_dir():
            return
        lm = model_on_meta(model)
        names = [name for name, _ in lm.named_modules()]
        for i, target in enumerate(self.target_modules):
            if not any(name == target or name.endswith(f".{target}") for name in names):
                linear = sorted({name.rpartition(".")[2] for name, module in lm.named_modules() if isinstance(module, nn.Linear)})
                raise SettingError(
                    f"lora.target_modules[{i}]", f"{target!r} is no layer of {model} (its linear layers are called {', '.join(linear)})"
                )
        try:
            inject_adapter_in_model(self.peft_config(), lm, low_cpu_mem_usage=True)
        except ValueError as exc:  # a module peft cannot adapt (not a linear, embedding or convolution layer)
            # peft's message prints the whole module: its class is enough
            reason = re.sub(
                r"\s+",
                " ",
                re.sub(r"Target module (\w+)\(.*?\) is not supported", r"Target module \1 is not supported", str(exc), flags=re.S),
            )
            raise SettingError("lora.target_modules", f"peft cannot adapt them in {model}: {reason[:300]}") from None


# Every config's schema by name: a stage's whole config (its package registers it on import) or a
# shared group's (the module that reads the group registers it). Hydra learns them when a config
# is loaded, so importing a schema does not import Hydra.
SCHEMAS: dict[str, tuple[type, str | None]] = {}


def register_schema(name: str, schema: type) -> None:
    """A shared group's schema (``configs/<name>/``): each of its YAML files starts from it
    (``defaults: [_schema, _self_]``), so a key the dataclass lacks or a value of the wrong type
    fails at load, naming the key, and :func:`build` makes the object."""
    SCHEMAS[name] = (schema, None)


def register_stage_schema(stage: str, schema: type) -> None:
    """A stage's whole config as a dataclass (``<stage>/config.py``), registered as
    ``<stage>/_schema``: each preset starts from it (``defaults: [_schema, ...]``), so every key of
    the stage is a field, and a misspelt or added key (``+train.lerning_rate=1``) or a value of
    the wrong type fails at load, naming the key. The stage's package registers it on import, so
    the core names no stage."""
    SCHEMAS[stage] = (schema, "_global_")


# What Hydra's ConfigStore holds already, by name: storing a schema converts its dataclass into a
# config (about 0.1 s for the whole set), so each is stored once per process, and again only when
# its registration changed. The store outlives GlobalHydra.clear().
_STORED: dict[str, tuple[type, str | None]] = {}


def _store_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, entry in SCHEMAS.items():
        if _STORED.get(name) != entry:
            schema, package = entry
            store.store(group=name, name="_schema", node=schema, package=package)
            _STORED[name] = entry


def load_config(stage: str, preset: str = "tiny", overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``configs/<stage>/<preset>.yaml`` with overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    root = config_dir()
    if preset not in presets(stage):
        raise UserError(f"no preset {preset!r} for stage {stage!r} in {root / stage} (have: {', '.join(presets(stage)) or 'none'})")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    if stage not in SCHEMAS:
        raise UserError(
            f"configs/{stage} has no schema registered: its package registers it when imported "
            f"(register_stage_schema in {stage}/__init__.py); import the stage before loading its config"
        )
    _store_schemas()
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
    check_composed(stage, cfg, f"{root / stage / preset}.yaml", overrides)
    return cfg


def load_settings(stage: str, preset: str = "tiny", overrides: Sequence[str] = ()):
    """The typed config a stage runs with: :func:`load_config`, checked, then built into the
    stage's schema (a shared group's preset: its group's object). Built once, where the command
    line is read (etagent/stage_cli.py), and passed down as it is: nothing below rebuilds a part."""
    cfg = load_config(stage, preset, overrides)
    schema, package = SCHEMAS[stage]
    return build(schema, cfg[stage] if package is None else cfg)


def check_composed(stage: str, cfg: DictConfig, preset_file: str, overrides: Sequence[str] = ()) -> None:
    """What :func:`load_config` checks once Hydra has composed a config (from ``preset_file`` and
    ``overrides``, which the messages name): no key its schema lacks, none left unset, and every
    value within its declaration (ranges, choices, finite numbers: etagent/settings.py)."""
    where = f"{preset_file} with overrides {' '.join(overrides) or '(none)'}"
    added = sorted(_keys_outside_schema(cfg))
    if added:  # Hydra's +key=value adds a key even to a structured group
        raise UserError(f"{where}: {', '.join(added)} is not a setting of its group (not a field of its schema)")
    missing = sorted(missing_keys(cfg))
    if missing:
        raise UserError(
            f"{preset_file} leaves {', '.join(missing)} unset (??? in _base.yaml, no default): set them in the preset or on the command line"
        )
    schema, package = SCHEMAS[stage]
    try:
        values = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:  # an interpolation of a key or an environment variable that is not there
        key, exc = _unresolved(cfg, overrides, exc)
        raise SettingError(key, f"its interpolation does not resolve: {_resolution_failure(exc)} ({where})") from None
    shared_group = package is None  # a shared group's own file composes under the group's name
    derived = frozenset(interpolated_keys(cfg[stage] if shared_group else cfg))
    try:
        validate(schema, values[stage] if shared_group else values, derived)
    except SettingError as error:
        key = f"{stage}.{error.key}" if shared_group else error.key
        raise SettingError(key, f"{error.reason} ({where})") from None


def _unresolved(cfg: DictConfig, overrides: Sequence[str], exc: OmegaConfBaseException) -> tuple[str, BaseException]:
    """The key to name for an interpolation that does not resolve, and its error: an override's key
    where one does not resolve (``model=${oc.env:X}``, not ``engine.model``, whose ``${model}``
    OmegaConf met first), else the key OmegaConf met it at."""
    overridden = {override.lstrip("+~").split("=", 1)[0] for override in overrides}
    for key in interpolated_keys(cfg):
        if key in overridden:
            try:
                OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
            except OmegaConfBaseException as own:
                return key, own
    return exc.full_key or "(config)", exc


def _resolution_failure(exc: BaseException) -> str:
    """Why OmegaConf could not resolve an interpolation, in one line: the message of the error a
    resolver raised where OmegaConf wraps one ("KeyError raised while resolving interpolation:
    "Environment variable 'X' not found"")."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    wrapped = re.fullmatch(r"(\w+) raised while resolving interpolation: (.*)", line)
    if wrapped is None:
        return line
    kind, message = wrapped.groups()
    return message[1:-1] if kind == "KeyError" and message[:1] == message[-1:] == '"' else message  # a KeyError's str() quotes its message


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


def missing_keys(cfg: DictConfig | ListConfig, path: str = "") -> list[str]:
    """The keys left at ``???``, named as ``OmegaConf.missing_keys`` names them (``a.b``, ``a[0]``).
    It walks the nodes without reading their values: OmegaConf's own walk resolves every value on
    its way and was half of what a config check costs (every stage start, every test that loads a
    config), and raised on an interpolation of an unset key (``engine.model: ${model}`` with
    ``model=???``); tests/test_configs.py checks the two agree."""
    keys = []
    listed = isinstance(cfg, ListConfig)
    for key in range(len(cfg)) if listed else cfg.keys():
        node = cfg._get_node(key)
        name = f"{path}[{key}]" if listed else f"{path}.{key}" if path else str(key)
        if node._is_missing():
            keys.append(name)
        elif isinstance(node, (DictConfig, ListConfig)) and not node._is_none():
            keys += missing_keys(node, name)
    return keys


def interpolated_keys(cfg: DictConfig, path: str = "") -> list[str]:
    """Keys whose value is an interpolation (``${...}``): they take another setting's value."""
    keys = []
    for key in cfg.keys():
        node = cfg._get_node(key)
        if node._is_interpolation():
            keys.append(f"{path}{key}")
        elif isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            keys += interpolated_keys(node, f"{path}{key}.")
    return keys


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
    or a value of the wrong type); ranges and choices are not checked here but where the config
    was loaded (:func:`load_config` validates every declaration: etagent/settings.py)."""
    from omegaconf import OmegaConf

    if isinstance(cfg, DictConfig):
        # resolved where it sits: ${model} means the stage's model, not a field of the group
        cfg = OmegaConf.to_container(cfg, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))


def base_group(schema: type[T], group: str, key: str = "", **changes) -> T:
    """A shared group's object from its ``configs/<group>/_base.yaml`` (``key`` selects a part:
    ``base_group(SandboxLimits, "tools", "python.limits")``) with ``changes`` over it: how code
    that runs without a stage's config (benches, tests) gets the documented values instead of
    restating them. A value the file leaves at ``???`` must be among ``changes``."""
    from omegaconf import OmegaConf

    values = OmegaConf.load(config_dir() / group / "_base.yaml")
    values.pop("defaults", None)
    if key:
        values = OmegaConf.select(values, key)
    return build(schema, OmegaConf.merge(values, changes))


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
