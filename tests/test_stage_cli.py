"""Every stage's command line as Hydra users know it (etagent/stage_cli.py): ``--cfg job``,
``--info``, ``-m`` sweeps into one output folder per run, ``--help`` listing every setting with
its doc, and one name per value (an override of a key that only follows another is refused,
naming the one to set)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from etagent.config import SCHEMAS, config_dir, load_settings, presets
from etagent.errors import UserError
from etagent.settings import settings_of
from etagent.stage_cli import documented_file, settings_help, stage_configs, sweep, yaml_docs
from tests.support.commands import TOKEN

STAGES = sorted(name for name, (_, package) in SCHEMAS.items() if package == "_global_" and presets(name))
MODULES = {
    "direct_rollout": "etagent.direct_rollout.run",
    "evaluation": "etagent.evaluation.run",
    "flywheel": "etagent.flywheel.run",
    "pareto": "etagent.pareto.run",
    "radar": "etagent.radar.run",
    "retriever": "etagent.retriever.build",
    "rl": "etagent.rl.run",
    "sft": "etagent.sft.run",
}


def test_every_stage_has_a_command():
    assert set(MODULES) == set(STAGES) - {"toy", "toy_hard"}  # both built by `etagent toy build`


def test_cfg_job_prints_the_resolved_config():
    done = subprocess.run(
        [sys.executable, "-m", "etagent.rl.run", "--cfg", "job", "optim.lr=0.002"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    expected = dataclasses.asdict(load_settings("rl", "tiny", ["optim.lr=0.002"]))
    assert printed == expected and printed["optim"]["lr"] == 0.002
    assert "${" not in done.stdout  # every interpolation resolved


def test_info_says_where_the_config_comes_from_and_what_the_run_reads_and_writes():
    done = subprocess.run(
        [sys.executable, "-m", "etagent.evaluation.run", "--info", "model=runs/x/model"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert str(config_dir() / "evaluation" / "tiny.yaml") in done.stdout
    assert "/engine@engine: tiny" in done.stdout and "overrides: model=runs/x/model" in done.stdout
    assert "  model = runs/x/model (model)" in done.stdout and "  out_dir = " in done.stdout


@pytest.mark.parametrize("stage", STAGES)
def test_help_lists_every_setting_and_documents_every_top_level_key(stage):
    listing = settings_help(stage)
    lines = {line.split()[0]: line for line in listing.splitlines()[1:]}
    keys = [s.key for s in settings_of(SCHEMAS[stage][0])]
    assert set(lines) == set(keys)
    # every key the stage's own _base.yaml documents has its doc in the listing
    documented = yaml_docs(documented_file(stage))
    for key in keys:
        if key in documented:
            assert len(lines[key].split(None, 1)[1]) > 25, key
    undocumented = [key for key in keys if "." not in key and key not in documented]
    assert not undocumented, f"configs/{stage}/_base.yaml documents no comment for {undocumented}"


def test_help_on_the_command_line():
    done = subprocess.run([sys.executable, "-m", "etagent.rl.run", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "--cfg" in done.stdout and "-m, --multirun" in done.stdout
    assert "optim.lr" in done.stdout and "engine.model" in done.stdout and "follows model" in done.stdout


@pytest.mark.parametrize("stage", STAGES)
def test_a_key_that_follows_another_is_refused_naming_the_one_to_set(stage):
    """Walks every key whose value in a stage's _base.yaml is another key's (``engine.model:
    ${model}``): overriding it would part the two names."""
    aliases = {key: doc for key, doc in yaml_docs(documented_file(stage)).items() if doc.startswith("follows ")}
    for key, doc in aliases.items():
        source = doc.split()[1]
        with pytest.raises(UserError, match=rf"setting {key}: is {source}'s value.*set {source}=\.\.\. instead"):
            stage_configs(stage, [f"{key}=x"], prog=stage)
    if stage in ("direct_rollout", "evaluation", "flywheel", "rl"):  # the model has one name in every stage that samples
        assert aliases.get("engine.model") == "follows model (set that)"
        assert load_settings(stage, "tiny", ["model=elsewhere"]).engine.model == "elsewhere"


def test_a_key_made_to_follow_another_is_refused_in_the_same_process(tmp_path, monkeypatch):
    """The keys that follow others are read once per process while no config file changes: a
    preset edited between two launches in one process is read again."""
    import shutil
    import time

    configs = tmp_path / "configs"
    shutil.copytree(config_dir(), configs)
    monkeypatch.setenv("ETAGENT_CONFIG_DIR", str(configs))
    assert stage_configs("sft", ["seed=3"], prog="sft")[0].seed == 3
    preset = configs / "sft" / "tiny.yaml"
    time.sleep(0.01)  # a new modification time even where the file system counts coarsely
    preset.write_text(preset.read_text() + "seed: ${train.max_steps}\n")
    with pytest.raises(UserError, match=r"setting seed: is train.max_steps's value.*set train.max_steps=\.\.\. instead"):
        stage_configs("sft", ["seed=3"], prog="sft")


def test_sweep_expands_like_hydra_and_names_each_run(tmp_path):
    jobs = sweep(["seed=0,1", "n=2", "limit=range(1,3)"])
    assert [line for line, _ in jobs] == [
        ["seed=0", "n=2", "limit=1"],
        ["seed=0", "n=2", "limit=2"],
        ["seed=1", "n=2", "limit=1"],
        ["seed=1", "n=2", "limit=2"],
    ]
    assert [name for _, name in jobs] == ["seed=0,limit=1", "seed=0,limit=2", "seed=1,limit=1", "seed=1,limit=2"]
    with pytest.raises(UserError, match="no override sweeps anything"):
        sweep(["seed=0"])
    out = tmp_path / "sweep"
    configs = stage_configs("evaluation", ["-m", "seed=0,1", f"out_dir={out}"], prog="evaluation")
    assert [(c.seed, c.out_dir) for c in configs] == [(0, str(out / "seed=0")), (1, str(out / "seed=1"))]


@given(
    st.lists(st.text(st.characters(codec=None, categories=None), max_size=3), min_size=1, max_size=3),
    st.lists(
        st.text(st.characters(codec=None, categories=None) | st.sampled_from("/\\_%,=.~\udc80"), max_size=150), min_size=2, max_size=2
    ),
    st.lists(
        st.text(st.characters(codec=None, categories=None) | st.sampled_from("/\\_%,=.~\udc80"), max_size=150), min_size=2, max_size=2
    ),
)
@settings(max_examples=400, deadline=None)
def test_distinct_sweep_runs_never_share_a_folder(keys, first, second):
    """The class: two runs of one sweep (the same keys, values of any characters: separators,
    ``_`` beside ``/``, ``%``, the ``,`` and ``=`` that join the pairs, unicode, a command line's
    undecodable bytes, values long enough to be cut) get distinct folder names, each one path
    component within the file system's 255 bytes, which decodes back to the pairs where it is
    not cut."""
    from urllib.parse import unquote

    from etagent.stage_cli import run_folder

    runs = [list(zip(keys, values)) for values in (first, second)]
    names = [run_folder(pairs) for pairs in runs]
    for pairs, name in zip(runs, names):
        encoded = name.encode(errors="surrogatepass")
        assert len(encoded) <= 255 and "/" not in name and "\\" not in name and "\0" not in name and name not in (".", "..")
        if len(",".join(f"{k}={v}" for k, v in pairs).encode(errors="surrogatepass")) < 80:  # never cut
            decoded = [tuple(unquote(part, errors="surrogatepass") for part in pair.split("=")) for pair in name.split(",")]
            assert decoded == pairs
    assert (names[0] == names[1]) == (runs[0] == runs[1])


def test_sweep_values_that_differ_in_a_separator_get_their_own_folders(tmp_path):
    out = tmp_path / "sweep"
    configs = stage_configs("evaluation", ["-m", "run_name=a/b,a_b,a%2Fb", f"out_dir={out}"], prog="evaluation")
    assert [(c.run_name, c.out_dir) for c in configs] == [
        ("a/b", str(out / "run_name=a%2Fb")),
        ("a_b", str(out / "run_name=a_b")),
        ("a%2Fb", str(out / "run_name=a%252Fb")),
    ]
    long = ["x" * 300 + "1", "x" * 300 + "2"]
    configs = stage_configs("evaluation", ["-m", f"run_name={','.join(long)}", f"out_dir={out}"], prog="evaluation")
    names = [Path(c.out_dir).name for c in configs]
    assert names[0] != names[1] and all(len(name.encode()) <= 255 for name in names)
    with pytest.raises(UserError, match="-m: the runs 'run_name=Eval' and 'run_name=eval' would share the output folder"):
        stage_configs("evaluation", ["-m", "run_name=Eval,eval", f"out_dir={out}"], prog="evaluation")
    assert not out.exists()


def test_a_sweep_runs_two_evaluations_into_two_folders(toy, server, tmp_path, monkeypatch):
    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)
    out = tmp_path / "sweep"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "etagent.evaluation.run",
            "-m",
            "seed=0,1",
            f"model={toy / 'model'}",
            f"files.toy={toy / 'questions' / 'test.jsonl'}",
            f"tools.search.local.url={server}",
            "tools.search.local.token_env=RETRIEVER_TOKEN",
            "agent.max_response_tokens=32",
            "agent.max_segment_tokens=32",
            "n=1",
            "limit=2",
            "bootstrap_rounds=10",
            f"out_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for seed in (0, 1):
        manifest = json.loads((out / f"seed={seed}" / "manifest.json").read_text())
        assert manifest["status"] == "complete" and manifest["config"]["seed"] == seed
        assert manifest["config"]["out_dir"] == str(out / f"seed={seed}")
    assert sorted(p.name for p in out.iterdir()) == ["seed=0", "seed=1"]
