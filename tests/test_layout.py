"""The repository's rules that code review alone would let slip: no stage imports another stage
(shared code lives in etagent/), and the core imports no stage, not even by a module name
written as a string (for importlib or ``python -m``); only the launcher (the ``etagent``
command) reaches every stage. Read from the source with ast, so an import inside a function
counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("flywheel", "direct_rollout", "pareto", "sft", "rl", "retriever", "evaluation", "radar", "report")


def owner(module: str) -> str | None:
    """The folder a module's code lives in: a stage's (``etagent.rl.run`` is rl/'s), the core's
    (``etagent.records`` is etagent/'s), or None for another project's module."""
    parts = module.split(".")
    if parts[0] != "etagent":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in STAGES + ("launcher",) else "etagent"


def imported_packages(path: Path) -> set[str]:
    """The folders of this repository that a file imports from (inside functions too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {owner(name) for name in names} - {None}


@pytest.mark.parametrize("package", STAGES + ("etagent",))
def test_no_stage_imports_another_stage(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python files"
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(imported_packages(path) & set(STAGES))
        if name != package
    ]
    assert not offences, "stages share code through etagent/, never through each other:\n" + "\n".join(offences)


def module_names_in_strings(path: Path) -> set[str]:
    """String constants that name a module of a stage that exists in this repository
    ("etagent.rl.run", "etagent.evaluation.metrics"; not "rl.parquet" or "sft.jsonl")."""
    pattern = re.compile(rf"^etagent\.({'|'.join(STAGES)})(\.[A-Za-z_]\w*)+$")
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
            module = ROOT.joinpath(*node.value.split(".")[1:])
            if module.with_suffix(".py").is_file() or (module / "__init__.py").is_file():
                names.add(node.value)
    return names


@pytest.mark.parametrize("package", STAGES + ("etagent",))
def test_no_module_of_another_stage_is_named_in_a_string(package):
    offences = [
        f"{path.relative_to(ROOT)} names {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in sorted(module_names_in_strings(path))
        if owner(name) != package
    ]
    assert not offences, "a module name in a string is an import the rule above cannot see:\n" + "\n".join(offences)


def test_the_string_rule_sees_module_names_and_not_file_names(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        'import importlib\nimportlib.import_module("etagent.rl.run")\nARGS = ["-m", "etagent.evaluation.run"]\nOUT = "rl.parquet"\n'
    )
    assert module_names_in_strings(module) == {"etagent.rl.run", "etagent.evaluation.run"}


def test_the_launcher_reaches_every_stage():
    assert imported_packages(ROOT / "launcher" / "main.py") >= set(STAGES)


def test_the_rule_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from etagent.evaluation.metrics import aggregate\n    import etagent.radar.chart\n")
    assert imported_packages(module) >= {"evaluation", "radar"}


FOLDERS = STAGES + ("launcher",)


def test_every_stage_installs_under_the_etagent_package():
    """pyproject.toml maps each stage's folder to ``etagent.<folder>`` and lists every package the
    wheel holds, so no generic top-level name (``rl``, ``report``) is installed beside another
    project's, and no folder with code is left out of the wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders_with_code = {
        str(init.parent.relative_to(ROOT))
        for init in ROOT.glob("*/**/__init__.py")
        if init.parts[len(ROOT.parts)] in FOLDERS + ("etagent",)
    }
    mapped = {name: folder for name, folder in setuptools["package-dir"].items()}
    installed_folders = {
        str(Path(mapped[name.rsplit(".", 1)[0]]) / name.rsplit(".", 1)[1]) if name not in mapped else mapped[name]
        for name in setuptools["packages"]
    }
    assert all(name == "etagent" or name.startswith("etagent.") for name in setuptools["packages"])
    assert {f"etagent.{folder}": folder for folder in FOLDERS}.items() <= mapped.items()
    assert installed_folders == folders_with_code


_FOLDER = "|".join(FOLDERS)
# a module named by its folder alone: run (-m rl.run), imported (from rl.reward import, import rl),
# or written as a string ("rl.run"; a file like "rl.parquet" is told apart by the folder's files)
OLD_NAMES = [
    re.compile(rf"(?<![\w.])-m ((?:{_FOLDER})(?:\.\w+)*)"),
    re.compile(rf"[\"']-m[\"'],\s*[\"']((?:{_FOLDER})(?:\.\w+)*)[\"']"),
    re.compile(rf"(?:^|[;\"'])\s*from ((?:{_FOLDER})(?:\.\w+)*) import "),
    re.compile(rf"(?:^|[;\"'])\s*import ((?:{_FOLDER})(?:\.\w+)*)\b"),
    re.compile(rf"[\"'`]((?:{_FOLDER})(?:\.\w+)+)[\"'`]"),
]


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_no_file_names_a_stage_module_by_its_folder_alone():
    """Installed, ``rl.run`` does not exist: code, scripts and docs name ``etagent.rl.run``
    (``python -m etagent.rl.run``, ``from etagent.rl.reward import ...``)."""
    offences = []
    for path in sorted(ROOT.glob("**/*")):
        if path.suffix not in {".py", ".sh", ".md", ".yaml", ".toml"} or path.is_symlink() or not path.is_file() or path == Path(__file__):
            continue
        if {".venv", "runs", ".git", "resolved"} & set(path.relative_to(ROOT).parts) or path.name.endswith(".egg-info"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(is_module(match.group(1)) for pattern in OLD_NAMES for match in pattern.finditer(line)):
                offences.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offences, "name stage modules as etagent.<stage>.<module>:\n" + "\n".join(offences)


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
    """etagent/settings.py, etagent/json_text.py and etagent/errors.py import nothing of the core but
    each other (settings reads a model folder's JSON as every reader does), and
    etagent/config.py (loading configs) imports no module that defines a group: each group's
    module registers its own schema, so there is no import circle through config.py."""
    core = ROOT / "etagent"
    assert imported_modules(core / "errors.py") == set()
    assert imported_modules(core / "settings.py") <= {"etagent.errors", "etagent.json_text"}
    assert imported_modules(core / "json_text.py") <= {"etagent.errors"}
    assert imported_modules(core / "config.py") <= {"etagent.errors", "etagent.settings", "etagent.rundir"}
    assert imported_modules(core / "rundir.py") <= {"etagent.errors", "etagent.settings", "etagent.records"}


def test_no_test_module_imports_another_or_the_conftest():
    """What tests share lives in tests/support/ (helpers, doubles, command lines) or is a fixture
    of tests/conftest.py; a test module importing another (or the conftest) hides that chain."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if re.fullmatch(r"tests\.(conftest|test_\w+)", name):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not offenders, offenders
