"""The toolkit as a user installs it: a wheel of this repository (``pip install .``, not
editable) in a fresh virtual environment runs a stage with the presets it ships, and imports
beside TRL's release. Offline: the wheel is installed without dependencies, which the fresh
environment reads from the test environment's site-packages (a ``.pth`` line does not run the
editable install's finder, so nothing of the repository is importable there)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.support.commands import TOKEN

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_non_editable_install_runs_evaluate_beside_trl(toy, server, tmp_path):
    # built from a copy of the tracked files: a build writes build/ and egg-info into its source
    source = tmp_path / "source"
    for name in subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name, follow_symlinks=False)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("etagent-*.whl")
    # one top-level name, so nothing of ours can shadow another project's module (a `report` or an `rl`)
    with zipfile.ZipFile(wheel) as archive:
        top_level = {name.split("/")[0] for name in archive.namelist()}
    assert top_level == {"etagent", "etagent-0.1.0.dist-info"}, top_level
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)], check=True, timeout=600
    )

    elsewhere = tmp_path / "elsewhere"  # not the repository: its folders must not be what is imported
    elsewhere.mkdir()
    where = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util, json, etagent, etagent.rl.run, etagent.rl.trl_reward, trl\n"
            "print(json.dumps([etagent.__file__, etagent.rl.run.__file__, trl.__version__, importlib.util.find_spec('rl')]))",
        ],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert where.returncode == 0, where.stderr[-2000:]
    etagent_file, rl_file, trl_version, top_level_rl = json.loads(where.stdout)
    assert etagent_file.startswith(str(site)) and rl_file.startswith(str(site)) and trl_version == "1.16.0"
    assert top_level_rl is None

    out = tmp_path / "eval"
    done = subprocess.run(
        [
            venv / "bin" / "etagent",
            "evaluate",
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
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "RETRIEVER_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert json.loads((out / "summary.json").read_text())["datasets"]["toy"]["samples"] == 2


def test_every_optional_module_names_the_extra_that_installs_it():
    """etagent/errors.py's EXTRAS against pyproject.toml: each module's distribution is in the
    extra it names, every extra's distributions are covered, and a stage missing one says which
    extra to install, in one line."""
    import importlib.metadata
    import re

    import tomllib

    from etagent.errors import EXTRAS, user_error_line

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    distribution_of = {module: dists[0] for module, dists in importlib.metadata.packages_distributions().items() if dists}

    def names(extra):
        return {re.split(r"[<>=\[ ]", requirement)[0].lower().replace("_", "-") for requirement in extras[extra]}

    for module, extra in EXTRAS.items():
        if extra == "gpu":  # not installable here: its modules are named in the extra itself
            assert module in names("gpu"), module
            continue
        distribution = distribution_of[module].lower().replace("_", "-")
        assert distribution in names(extra), (module, distribution, extra)
    for extra in ("retriever", "ray", "logging", "charts", "data"):
        covered = {distribution_of[m].lower().replace("_", "-") for m, e in EXTRAS.items() if e == extra}
        assert names(extra) <= covered | {"uvicorn"}, (extra, names(extra) - covered)
        assert extra in extras["all"][0]
    line = user_error_line(ModuleNotFoundError("No module named 'ray'", name="ray"))
    assert line == "this needs ray, from the 'ray' extra: pip install 'etagent[ray]' (or 'etagent[all]' for every CPU extra)"


def test_a_stage_without_its_extra_exits_2_naming_it(tmp_path):
    """matplotlib made unimportable (as in an install without the charts extra): the radar stage
    refuses in one line, exit 2."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'matplotlib':\n"
        "            raise ModuleNotFoundError(f\"No module named '{name}'\", name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from etagent.errors import exit_on_user_error\nfrom etagent.radar.chart import figure\nexit_on_user_error(figure)({'run': {}})",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "'charts' extra" in done.stderr, done.stderr
