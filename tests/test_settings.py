"""Every setting is declared once (etagent/settings.py), and every check comes from the declaration.

The walk below needs no list of fields: it reads every schema registered for a config folder
(stages and shared groups), every preset of it, and every setting of the schema, and feeds each
setting the values its declaration refuses (one past each bound, a wrong choice, NaN and both
infinities for numbers) through the checks ``load_config`` runs after Hydra composes. A bound that
a declaration forgets cannot hide: every number must declare one.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ValidationError as OmegaConfValidationError

from etagent.config import SCHEMAS, check_composed, load_config, presets
from etagent.errors import SettingError
from etagent.settings import Ge, Gt, Le, Lt, free_keys, out_of_range_values, settings_of

# the config folders with a schema (the sampling group has none of its own: it sits inside others)
SCHEMA_NAMES = sorted(name for name in SCHEMAS if presets(name))


def _set(cfg: DictConfig, key: str, container, value) -> str:
    """Set ``value`` at ``key`` (for a list or dict setting, its first element, or a new one);
    returns the key the refusal should name."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if container is None:
        parent[leaf] = value
        return key
    node = parent[leaf]
    if container is list:
        if node is None or len(node) == 0:
            parent[leaf] = [value]
        else:
            node[0] = value
        return f"{key}[0]"
    name = next(iter(node), "added") if node else "added"
    if node is None:
        parent[leaf] = {name: value}
    else:
        with open_dict(node):  # a new key, as `+key.name=value` adds it on the command line
            node[name] = value
    return f"{key}.{name}"


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_setting_refuses_what_its_declaration_refuses_at_load(name):
    schema, package = SCHEMAS[name]
    # a shared group's own file composes under the group's name
    settings = settings_of(schema, f"{name}." if package is None else "")
    assert settings, name
    tried = 0
    for preset in presets(name):
        cfg = load_config(name, preset)
        for setting in settings:
            if OmegaConf.select(cfg, setting.key.rpartition(".")[0] or setting.key, default=None) is None and "." in setting.key:
                continue  # a group that is null in this stage (RL's engine.openai)
            changed = copy.deepcopy(cfg)  # each value below is set at the same place, over the one before
            for value in out_of_range_values(setting):
                try:
                    named = _set(changed, setting.key, setting.container, value)
                except OmegaConfValidationError:
                    tried += 1  # refused by its type already (inf into an integer)
                    continue
                with pytest.raises(SettingError) as refusal:
                    check_composed(name, changed, f"configs/{name}/{preset}.yaml")
                assert refusal.value.key == named, (name, preset, setting.key, value, str(refusal.value))
                assert "\n" not in str(refusal.value)
                tried += 1
    assert tried > 0


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_number_declares_a_range_and_every_preset_is_within_its_declarations(name):
    schema = SCHEMAS[name][0]
    for setting in settings_of(schema):
        if setting.type in (int, float):
            assert any(isinstance(m, (Ge, Gt, Le, Lt)) for m in setting.metadata), f"{name}: {setting.key} declares no range"
    for preset in presets(name):
        load_config(name, preset)  # raises if a preset's own value is out of its declaration


def test_resume_freedom_comes_from_the_declarations():
    from etagent.rl.config import RLConfig
    from etagent.sft.config import SFTConfig

    sft_free = free_keys(SFTConfig)
    assert {"threads", "train.logging_steps", "wandb.enabled", "tensorboard.enabled", "out_dir"} <= set(sft_free)
    assert "train.learning_rate" not in sft_free and "model" not in sft_free
    rl_free = free_keys(RLConfig)
    assert {"train.max_steps", "tools.max_failure_share", "tools.search.local.url", "engine.max_batch_size"} <= set(rl_free)
    assert "optim.lr" not in rl_free and "reward.sigma_tool" not in rl_free


@pytest.mark.parametrize(
    "stage, override, key",
    [
        ("sft", "train.learning_rate=inf", "train.learning_rate"),
        ("sft", "train.max_grad_norm=nan", "train.max_grad_norm"),
        ("rl", "optim.grad_clip=nan", "optim.grad_clip"),
        ("rl", "optim.lr=inf", "optim.lr"),
        ("rl", "reward.sigma_length=-inf", "reward.sigma_length"),
        ("evaluation", "tools.max_failure_share=nan", "tools.max_failure_share"),
        ("evaluation", "agent.sampling.top_p=nan", "agent.sampling.top_p"),
        ("retriever", "serve.port=70000", "serve.port"),
        ("direct_rollout", "qa_pass_mark=inf", "qa_pass_mark"),
    ],
)
def test_non_finite_and_out_of_range_settings_are_refused_by_the_real_cli(stage, override, key, tmp_path):
    """Through the real command line: exit 2, one line naming the key, nothing written."""
    module = {"retriever": "etagent.retriever.build"}.get(stage, f"etagent.{stage}.run")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", module, override, f"{'index_dir' if stage == 'retriever' else 'out_dir'}={out}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: setting {key}:"), result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_the_values_refused_follow_the_bounds():
    from etagent.settings import OneOf, Setting

    number = Setting("x", float, (Gt(0), Le(1)), False)
    values = out_of_range_values(number)
    assert values[:2] == [0, 1.5] and math.isnan(values[2]) and values[3:] == [math.inf, -math.inf]
    assert out_of_range_values(Setting("n", int, (Ge(1),), False))[0] == 0
    assert out_of_range_values(Setting("k", str, (OneOf("a", "b"),), False)) == ["not-a-b"]


@pytest.mark.parametrize("sigma", ["NaN", "Infinity", "-1"])
def test_the_reward_command_checks_its_sigmas_by_their_declaration(sigma):
    """``etagent reward`` reads RL's reward settings from each JSON line (JSON as Python reads it
    admits NaN and Infinity): the same declaration refuses them, naming the line and field."""
    line = (
        '{"data_source": "math_effi_rl", "ground_truth": ["4"], "responses": ["<answer>\\\\boxed{4}</answer>"], '
        f'"lengths": [5], "sigma_tool": {sigma}, "sigma_length": 0.5}}\n'
    )
    result = subprocess.run([sys.executable, "-m", "etagent.launcher", "reward"], input=line, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: <stdin>:1: field 'sigma_tool': must be a") and "Traceback" not in result.stderr
