"""Presets complete in themselves (configs/<stage>/_base.yaml plus the preset, never another
preset), their committed resolved form current, and the paper presets against the paper's numbers
(docs/paper-code.md §A3, §C5.3-C5.5), with no toy value left."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import MISSING, DictConfig, ListConfig

from etagent.config import config_dir, load_config, presets, stages
from etagent.errors import UserError

ROOT = Path(__file__).parents[1]


def test_the_committed_resolved_presets_are_current():
    result = subprocess.run([sys.executable, "-m", "etagent.launcher", "configs", "--check"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_preset_builds_on_its_schema_and_base_not_on_another_preset():
    """Each preset starts from the stage's schema (the dataclass its package registers), then its
    base; the shared groups' presets start from their base, which starts from their schema."""
    for stage in stages():
        for preset in presets(stage):
            defaults = yaml.safe_load((config_dir() / stage / f"{preset}.yaml").read_text()).get("defaults", [])
            own = [d for d in defaults if isinstance(d, str)]
            if preset == "tiny_flywheel":  # a variant of the tiny preset by name and on purpose
                assert own == ["tiny", "_self_"]
            elif stage in ("engine", "agent", "tools"):
                assert own == ["_base", "_self_"], (stage, preset, own)
            elif (config_dir() / stage / "_base.yaml").exists():
                assert own == ["_schema", "_base", "_self_"], (stage, preset, own)
            else:
                assert own == ["_schema", "_self_"], (stage, preset, own)
            for group in (d for d in defaults if isinstance(d, dict)):  # shared groups: the preset's own kind
                (name, chosen), *_ = group.items()
                # the servers' group has one preset, the same pool settings for toy and paper runs
                paperlike = preset.startswith("paper")  # paper, and paper_1gpu: the paper on one GPU
                wanted = "servers" if name.startswith("/openai@") else "paper" if paperlike else "tiny"
                assert chosen == wanted, (stage, preset, group)


def test_the_servers_settings_sit_under_every_engine_that_may_use_them_and_not_under_rls():
    """kind openai needs engine.openai (configs/openai/servers.yaml): every engine of the stages
    that may serve a model that way has it; RL's engine, in the trainer's process, has none."""
    engines = {
        "evaluation": ["engine", "judge.engine"],
        "direct_rollout": ["engine"],
        "flywheel": ["engine", "editor.engine"],
        "radar": ["judge.engine"],
    }
    for stage, keys in engines.items():
        for preset in presets(stage):
            cfg = load_config(stage, preset)
            for key in keys:
                assert _value(cfg, f"{key}.openai.timeout_s") > 0, (stage, preset, key)
    for preset in presets("rl"):
        assert load_config("rl", preset).engine.openai is None


def test_a_preset_that_leaves_a_value_open_is_refused_naming_it(tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    shutil.copytree(config_dir(), configs)
    preset = (configs / "sft" / "paper.yaml").read_text().replace("  epochs: 3\n", "")
    (configs / "sft" / "forgetful.yaml").write_text(preset)
    monkeypatch.setenv("ETAGENT_CONFIG_DIR", str(configs))
    with pytest.raises(UserError, match=r"sft/forgetful.yaml leaves train.epochs unset"):
        load_config("sft", "forgetful")
    result = subprocess.run([sys.executable, "-m", "etagent.sft.run", "--preset", "forgetful"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode != 0 and "leaves train.epochs unset" in result.stderr


def _interpolation_targets(cfg: DictConfig) -> set[str]:
    """The settings other settings take their value from (``engine.model: ${model}`` -> ``model``)."""
    targets = set()
    for key in cfg.keys():
        node = cfg._get_node(key)
        if node._is_interpolation():
            targets |= set(re.findall(r"\$\{([\w.]+)\}", str(node._value())))
        elif isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            targets |= _interpolation_targets(node)
    return targets


@pytest.mark.parametrize("stage", stages())
def test_a_setting_others_take_their_value_from_left_unset_is_refused_naming_it(stage):
    """``model=???`` where the engine's model is ``${model}``: OmegaConf's own walk for unset keys
    raised on the interpolation (a 100-line traceback, exit 1); the check names the setting."""
    preset = presets(stage)[0]
    targets = sorted(_interpolation_targets(load_config(stage, preset)))
    for target in targets:
        with pytest.raises(UserError, match=rf"leaves {re.escape(target)} unset"):
            load_config(stage, preset, [f"{target}=???"])
    if stage == "direct_rollout":
        assert targets, "the direct rollout's engine.model is ${model}"
        result = subprocess.run(
            [sys.executable, "-m", "etagent.launcher", "direct-rollout", "model=???"], capture_output=True, text=True, cwd=ROOT
        )
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
        assert "leaves model unset" in result.stderr


def test_sft_paper_preset_has_the_papers_numbers():
    """3 epochs (max_steps -1: the tiny preset's 4800-step cap once leaked into it), lr 5e-6,
    cosine with warm-up 0.1, 1 x 8 accumulation per GPU, cutoff 10000, bf16, ZeRO-3."""
    from etagent.config import WandbConfig, build
    from etagent.sft.config import SFTTrainSettings
    from etagent.sft.run import training_arguments

    cfg = load_config("sft", "paper")
    t = cfg.train
    assert (t.epochs, t.max_steps, t.learning_rate, t.lr_scheduler, t.warmup_ratio) == (3, -1, 5e-6, "cosine", 0.1)
    assert (t.batch_size, t.gradient_accumulation_steps, cfg.cutoff_len) == (1, 8, 10000)
    assert (t.bf16, t.gradient_checkpointing, t.deepspeed, cfg.model_dtype) == (True, True, "configs/sft/ds_zero3.json", "bfloat16")
    assert cfg.model == "Qwen/Qwen2.5-7B-Instruct" and not cfg.lora.enabled
    tiny = load_config("sft", "tiny")
    for key in ("train.max_steps", "train.learning_rate", "train.batch_size", "cutoff_len", "model"):
        assert _value(cfg, key) != _value(tiny, key), key
    cfg = load_config("sft", "paper", ["train.deepspeed=null", "train.bf16=false"])
    args = training_arguments(build(SFTTrainSettings, cfg.train), build(WandbConfig, cfg.wandb), cfg.seed, Path("unused"))
    assert (args.num_train_epochs, args.max_steps) == (3, -1)


def test_rl_paper_preset_has_no_toy_value_left():
    """Every value the paper preset shares with the tiny one is a default of _base.yaml, and the
    sizes the paper gives are its own: 64 x 16, mini-batches of 4 prompts, lr 1e-6, prompt 2000 +
    response 4096, bf16 exports every 30 steps."""
    paper, tiny = load_config("rl", "paper"), load_config("rl", "tiny")
    assert (paper.data.prompts_per_step, paper.rollout.n, paper.train.mini_batch_prompts, paper.optim.lr) == (64, 16, 4, 1e-6)
    assert (paper.data.max_prompt_tokens, paper.agent.max_response_tokens, paper.engine.vllm.max_model_len) == (2000, 4096, 6096)
    assert (paper.train.save_every, paper.train.export_every, paper.train.export_dtype) == (30, 30, "bfloat16")
    base = yaml.safe_load((config_dir() / "rl" / "_base.yaml").read_text())
    for key in _keys(base):
        if _value(paper, key) == _value(tiny, key):
            assert _raw(base, key) != "???", key  # a shared value is a default, never a toy one


def _keys(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def _raw(tree, key):
    for part in key.split("."):
        tree = tree[part]
    return tree


def _value(cfg, key):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key)


@pytest.mark.parametrize("stage", stages())
def test_a_misspelt_key_in_any_preset_is_refused_before_work_naming_it(stage):
    """An override of a key no YAML defines fails at load time, naming the key, for every preset
    of every stage: a top-level typo, and one inside a group the stage has (its first group's
    first key with a letter dropped)."""
    for preset in presets(stage):
        cfg = load_config(stage, preset)
        group = next(key for key, value in cfg.items() if isinstance(value, DictConfig))
        leaf = next(iter(cfg[group]))
        for typo in (f"lerning_rate_{stage}", f"{group}.{leaf[:-1]}"):
            with pytest.raises(UserError, match=f"Could not override '{typo}'"):
                load_config(stage, preset, [f"{typo}=1"])


@pytest.mark.parametrize("stage", stages())
def test_every_typed_group_of_every_preset_builds_its_object(stage):
    """Wherever a preset holds a typed group (engine, agent, tools; the flywheel's editor.engine
    too), build() makes its dataclass with every interpolation resolved where the group sits:
    RL's engine.model is ${model}, the stage's model, not the group's own field."""
    from dataclasses import fields

    from omegaconf import OmegaConf

    from etagent.config import build

    for preset in presets(stage):
        cfg = load_config(stage, preset)
        nodes = [("", cfg)]
        while nodes:
            path, node = nodes.pop()
            for key in node:
                child = node._get_node(key)
                if not isinstance(child, DictConfig) or child._is_missing() or child._is_none():
                    continue
                schema = OmegaConf.get_type(child)
                if schema is not dict:
                    built = build(schema, child)
                    assert isinstance(built, schema), f"{stage}/{preset}: {path}{key}"
                    for field in fields(schema):
                        value = getattr(built, field.name)
                        assert not (isinstance(value, str) and "${" in value), f"{stage}/{preset}: {path}{key}.{field.name} = {value}"
                else:
                    nodes.append((f"{path}{key}.", child))
    rl = load_config("rl", "tiny", ["engine.kind=vllm", "model=somewhere/else"])
    from etagent.llm import EngineConfig

    assert build(EngineConfig, rl.engine).model == "somewhere/else"


def _random_tree(rng, depth: int, leaves: list[str], path: str = ""):
    """A random nest of dicts and lists whose leaves are numbers, strings, nulls, ``???`` and
    interpolations of leaves made before them (recorded in ``leaves``)."""
    if depth == 0 or rng.random() < 0.3:
        roll = rng.random()
        if roll < 0.25:
            return MISSING
        if roll < 0.35:
            return None
        if roll < 0.5 and leaves:
            return "${" + rng.choice(leaves) + "}"
        if path and "[" not in path:
            leaves.append(path)
        return rng.choice([0, 1.5, "text", True])
    if rng.random() < 0.3:
        return [_random_tree(rng, depth - 1, leaves, f"{path}[{i}]") for i in range(rng.randrange(4))]
    names = rng.sample("abcdefg", rng.randrange(1, 5))
    return {name: _random_tree(rng, depth - 1, leaves, f"{path}.{name}" if path else name) for name in names}


def test_missing_keys_names_what_omegaconfs_own_walk_names():
    """etagent.config.missing_keys (a walk over the nodes that reads no value) against
    OmegaConf.missing_keys: 1,000 random configs of dicts, lists, nulls, interpolations and
    ``???`` at every depth, then every preset of every stage with random settings and whole
    groups set to ``???``."""
    import random

    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import InterpolationResolutionError

    from etagent.config import missing_keys

    rng = random.Random(0)
    found = 0
    for _ in range(1000):
        tree = _random_tree(rng, 4, [], "root")
        cfg = OmegaConf.create({"root": tree})
        expected = OmegaConf.missing_keys(cfg)
        assert sorted(missing_keys(cfg)) == sorted(expected), tree
        found += len(expected)
    assert found > 500
    compared = 0
    for stage in stages():
        for preset in presets(stage):
            loaded = load_config(stage, preset)
            assert missing_keys(loaded) == []
            paths = _node_paths(loaded)
            for _ in range(2):
                cfg = copy.deepcopy(loaded)
                chosen = sorted(rng.sample(paths, min(len(paths), rng.randrange(1, 6))))
                with open_dict(cfg):  # a group first, then nothing under it (it has no keys left)
                    for path in [p for p in chosen if not any(p.startswith(f"{q}.") for q in chosen)]:
                        OmegaConf.update(cfg, path, MISSING, force_add=True)
                try:
                    expected = OmegaConf.missing_keys(cfg)
                except InterpolationResolutionError:  # its walk reads ${model} where model is ??? and raises
                    assert sorted(missing_keys(cfg)) == sorted(_literal_missing(OmegaConf.to_container(cfg, resolve=False)))
                    continue
                assert expected and sorted(missing_keys(cfg)) == sorted(expected), (stage, preset)
                compared += 1
    assert compared > 40


def _literal_missing(plain, path: str = "") -> list[str]:
    """The paths whose value is the string ``???`` in a config turned into plain dicts and lists."""
    if plain == MISSING:
        return [path]
    items = plain.items() if isinstance(plain, dict) else enumerate(plain) if isinstance(plain, list) else []
    listed = isinstance(plain, list)
    return [p for key, value in items for p in _literal_missing(value, f"{path}[{key}]" if listed else f"{path}.{key}" if path else key)]


def _node_paths(cfg: DictConfig, path: str = "") -> list[str]:
    """Every key under ``cfg``, groups and settings, as dotted paths."""
    from omegaconf import DictConfig as Dict

    paths = []
    for key in cfg.keys():
        name = f"{path}.{key}" if path else str(key)
        paths.append(name)
        node = cfg._get_node(key)
        if isinstance(node, Dict) and not node._is_none() and not node._is_missing():
            paths += _node_paths(node, name)
    return paths


def _scalar_settings(cfg: DictConfig, path: str = "") -> list[str]:
    """The dotted keys of the settings under ``cfg`` that hold a value of their own (not null, not a
    group, not a list, not another setting's value)."""
    keys = []
    for key in cfg.keys():
        name = f"{path}.{key}" if path else str(key)
        node = cfg._get_node(key)
        if isinstance(node, DictConfig):
            if not node._is_none() and not node._is_missing():
                keys += _scalar_settings(node, name)
        elif not isinstance(node, ListConfig) and not node._is_none() and not node._is_interpolation():
            keys.append(name)
    return keys


@pytest.mark.parametrize("stage", stages())
def test_an_interpolation_that_does_not_resolve_is_refused_naming_the_setting(stage, monkeypatch):
    """``key=${oc.env:UNSET}`` and ``key=${no_such_key}`` on two settings of every stage, chosen at
    random: one error naming the setting (OmegaConf's own was a 70-100-line traceback, exit 1).
    Where the override sets a value other settings take (``model``, which ``engine.model: ${model}``
    reads), the override's key is named, not the one OmegaConf met first."""
    import random

    from etagent.errors import SettingError

    monkeypatch.delenv("ETAGENT_TEST_UNSET", raising=False)
    preset = presets(stage)[0]
    cfg = load_config(stage, preset)
    keys = random.Random(stage).sample(_scalar_settings(cfg), 2)
    targets = sorted(_interpolation_targets(cfg))
    for key, value, reason in (
        (keys[0], "${oc.env:ETAGENT_TEST_UNSET}", "Environment variable 'ETAGENT_TEST_UNSET' not found"),
        (keys[1], "${no_such_key}", "Interpolation key 'no_such_key' not found"),
        *[(target, "${oc.env:ETAGENT_TEST_UNSET}", "Environment variable") for target in targets[:1]],
    ):
        with pytest.raises(SettingError, match=rf"^setting {re.escape(key)}: its interpolation does not resolve: {reason}") as error:
            load_config(stage, preset, [f"{key}={value}"])
        assert "\n" not in str(error.value)
    if stage == "evaluation":  # as a user runs it: exit 2, one line
        result = subprocess.run(
            [sys.executable, "-m", "etagent.launcher", "evaluate", "out_dir=${oc.env:ETAGENT_TEST_UNSET}"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
        assert result.stderr.startswith("error: setting out_dir: its interpolation does not resolve: Environment variable"), result.stderr


def _schemas_with_nested_groups() -> list[type]:
    """Every registered schema (each stage's and each shared group's) and every group nested in
    one, each once."""
    import dataclasses
    import importlib
    import typing

    import etagent.toy.config  # noqa: F401  (registers the toy world's schema)
    from etagent.config import SCHEMAS
    from etagent.settings import _unwrap

    for stage in stages():
        if stage not in SCHEMAS:
            importlib.import_module(f"etagent.{stage}")
    found: list[type] = []

    def walk(schema: type) -> None:
        if schema in found:
            return
        found.append(schema)
        hints = typing.get_type_hints(schema, include_extras=True)
        for f in dataclasses.fields(schema):
            plain = _unwrap(hints[f.name])[0]
            if dataclasses.is_dataclass(plain):
                walk(plain)

    for schema, _ in SCHEMAS.values():
        walk(schema)
    return found


def test_no_setting_has_a_default_in_python_yaml_holds_every_value():
    """One source per default: configs/<stage or group>/_base.yaml holds every value and its doc;
    a schema (the dataclass) holds the type and the range only. A nested group's field may make
    its group (``field(default_factory=Group)``), whose own fields are checked in turn."""
    import dataclasses

    offences = []
    schemas = _schemas_with_nested_groups()
    assert len(schemas) > 30
    for schema in schemas:
        for f in dataclasses.fields(schema):
            if f.default is not dataclasses.MISSING and f.default is not MISSING:
                offences.append(f"{schema.__module__}.{schema.__qualname__}.{f.name} = {f.default!r}")
            elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default_factory):
                offences.append(f"{schema.__module__}.{schema.__qualname__}.{f.name} = {f.default_factory()!r} (a factory)")
    assert not offences, "a default in Python as well as in YAML; keep it in _base.yaml only:\n" + "\n".join(offences)


def _leaves(values, path=""):
    if isinstance(values, dict):
        for key, value in values.items():
            yield from _leaves(value, f"{path}.{key}" if path else str(key))
    else:
        yield path, values


def test_no_preset_restates_what_it_builds_on(tmp_path):
    """A preset holds only what differs from what it builds on (its _base.yaml and the shared
    groups' presets it names, or the preset it varies): each of its values is compared with the
    config composed from its defaults list alone."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from etagent.config import SCHEMAS, _store_schemas

    _schemas_with_nested_groups()
    configs = tmp_path / "configs"
    shutil.copytree(config_dir(), configs)
    offences = []
    checked = 0
    for stage in stages():
        for preset in presets(stage):
            text = (config_dir() / stage / f"{preset}.yaml").read_text()
            own = yaml.safe_load(text) or {}
            defaults = own.pop("defaults", [])
            header = "# @package _global_\n" if text.startswith("# @package _global_") else ""
            (configs / stage / f"{preset}.yaml").write_text(header + yaml.safe_dump({"defaults": defaults}))
            GlobalHydra.instance().clear()
            _store_schemas()
            with initialize_config_dir(config_dir=str(configs), version_base=None):
                base = compose(config_name=f"{stage}/{preset}")
            (configs / stage / f"{preset}.yaml").write_text(text)
            if SCHEMAS[stage][1] is None:  # a shared group composes under its own name
                base = base[stage]
            for key, value in _leaves(own):
                checked += 1
                try:
                    before = OmegaConf.select(base, key, default="<absent>", throw_on_missing=False, throw_on_resolution_failure=False)
                except Exception as exc:  # a key below a null group or a scalar: not restated
                    before = f"<{type(exc).__name__}>"
                if isinstance(before, (DictConfig, ListConfig)):
                    before = OmegaConf.to_container(before, resolve=False)
                if before == value and type(before) is type(value):
                    offences.append(f"configs/{stage}/{preset}.yaml: {key}: {value!r}")
    assert checked > 300
    assert not offences, "a preset restates what it builds on; drop these keys:\n" + "\n".join(offences)
