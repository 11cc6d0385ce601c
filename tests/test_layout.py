"""The repository's rules that code review alone would let slip: no stage imports another stage
(shared code lives in etagent/), and the core imports no stage, not even by a module name
written as a string (for importlib or ``python -m``); only the launcher (the ``etagent``
command) reaches every stage. Read from the source with ast, so an import inside a function
counts too."""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest

from etagent.timing import phase

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("flywheel", "direct_rollout", "pareto", "sft", "rl", "retriever", "evaluation", "radar", "report")


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", STAGES + ("etagent",))
def test_no_stage_imports_another_stage(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files or package in ("flywheel", "direct_rollout", "pareto", "rl"), f"{package}/ has no Python files"
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(imported_packages(path) & set(STAGES))
        if name != package
    ]
    assert not offences, "stages share code through etagent/, never through each other:\n" + "\n".join(offences)


def module_names_in_strings(path: Path) -> set[str]:
    """String constants that name a module of a stage that exists in this repository
    ("rl.run", "evaluation.metrics"; not "rl.parquet" or "sft.jsonl")."""
    pattern = re.compile(rf"^({'|'.join(STAGES)})(\.[A-Za-z_]\w*)+$")
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
            module = ROOT.joinpath(*node.value.split("."))
            if module.with_suffix(".py").is_file() or (module / "__init__.py").is_file():
                names.add(node.value)
    return names


@pytest.mark.parametrize("package", STAGES + ("etagent",))
def test_no_module_of_another_stage_is_named_in_a_string(package):
    offences = [
        f"{path.relative_to(ROOT)} names {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in sorted(module_names_in_strings(path))
        if name.split(".")[0] != package
    ]
    assert not offences, "a module name in a string is an import the rule above cannot see:\n" + "\n".join(offences)


def test_the_string_rule_sees_module_names_and_not_file_names(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('import importlib\nimportlib.import_module("rl.run")\nARGS = ["-m", "evaluation.run"]\nOUT = "rl.parquet"\n')
    assert module_names_in_strings(module) == {"rl.run", "evaluation.run"}


def test_the_launcher_reaches_every_stage():
    assert imported_packages(ROOT / "launcher" / "main.py") >= set(STAGES)


def test_the_rule_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from evaluation.metrics import aggregate\n    import radar.chart\n")
    assert imported_packages(module) >= {"evaluation", "radar"}


def test_phases_add_up_and_survive_errors():
    metrics: dict[str, float] = {}
    with phase("generate", metrics):
        time.sleep(0.02)
        with phase("reward", metrics):
            time.sleep(0.01)
    with phase("generate", metrics):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), phase("update", metrics):
        raise RuntimeError("boom")
    assert set(metrics) == {"timing_s/generate", "timing_s/reward", "timing_s/update"}
    assert metrics["timing_s/generate"] >= 0.03 and 0.01 <= metrics["timing_s/reward"] < metrics["timing_s/generate"]


def imported_modules(path: Path) -> set[str]:
    """Every module an ``etagent`` file imports, by its full name, inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {name for name in names if name.startswith("etagent")}


def test_the_declarations_sit_at_the_bottom_and_config_imports_no_group():
    """etagent/settings.py and etagent/errors.py import nothing of the core but each other, and
    etagent/config.py (loading configs) imports no module that defines a group: each group's
    module registers its own schema, so there is no import circle through config.py."""
    core = ROOT / "etagent"
    assert imported_modules(core / "errors.py") == set()
    assert imported_modules(core / "settings.py") <= {"etagent.errors"}
    assert imported_modules(core / "config.py") <= {"etagent.errors", "etagent.settings", "etagent.rundir"}
    assert imported_modules(core / "rundir.py") <= {"etagent.errors", "etagent.settings", "etagent.records"}
