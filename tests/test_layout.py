"""The repository's rules that code review alone would let slip: no stage imports another stage
(shared code lives in etagent/), and the core imports no stage, not even by a module name
written as a string (for importlib or ``python -m``); only the launcher (the ``etagent``
command) reaches every stage. Read from the source with ast, so an import inside a function
counts too."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_every_stage_folder_is_a_module_of_etagent_by_one_link():
    """Each top-level folder with code is ``etagent.<folder>`` through the link etagent/<folder> ->
    ../<folder> (pyproject packages etagent and what lies under it), and its ``__init__`` refuses
    the folder's own name, so no module has two."""
    folders_with_code = {init.parent.name for init in ROOT.glob("*/__init__.py")} - {"etagent", "tests"}
    assert folders_with_code == set(FOLDERS)
    for folder in FOLDERS:
        link = ROOT / "etagent" / folder
        assert link.is_symlink() and os.readlink(link) == f"../{folder}", f"etagent/{folder} must link to ../{folder}"
        assert "one_name(__name__)" in (ROOT / folder / "__init__.py").read_text(), f"{folder}/__init__.py must call one_name"


# from elsewhere is the installed case, which test_install.py runs too (slow): the default run keeps
# the root, where a second name could appear
@pytest.mark.parametrize("where", ["root", pytest.param("elsewhere", marks=pytest.mark.slow)])
def test_python_dash_m_runs_a_stage_by_its_one_name_from_the_root_and_from_elsewhere(where, tmp_path):
    cwd = ROOT if where == "root" else tmp_path
    done = subprocess.run([sys.executable, "-m", "etagent.pareto.run", "--help"], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: python -m etagent.pareto.run" in done.stdout, done.stderr[-2000:]


def test_a_stage_imported_by_its_folders_name_is_refused_in_one_line():
    """From the repository's root ``rl`` is importable as a folder: importing it must fail at once,
    not load a second copy of every module (``rl.config.RLConfig is not etagent.rl.config.RLConfig``)."""
    done = subprocess.run([sys.executable, "-m", "pareto.run", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ImportError: the stage package 'pareto' is etagent.pareto: import it, or run it with python -m, under that name" in done.stderr


@pytest.mark.slow  # imports every module in a fresh process (10 s); the guard in each stage's __init__ is checked above
def test_every_module_is_loaded_once_under_one_name():
    """Every module of the project imported in one process (stages through their links): no file is
    behind two module names."""
    script = (
        "import importlib, pkgutil, sys, os, etagent\n"
        "skip = ('etagent.configs', '__main__')\n"
        "for info in pkgutil.walk_packages(etagent.__path__, 'etagent.'):\n"
        "    if not info.name.startswith(skip) and not info.name.endswith('__main__'):\n"
        "        try: importlib.import_module(info.name)\n"
        "        except ImportError as e:\n"
        "            if 'etagent' in (e.name or ''): raise\n"
        "files = {}\n"
        "for name, module in list(sys.modules.items()):\n"
        "    path = getattr(module, '__file__', None)\n"
        "    if path and os.path.realpath(path).startswith(sys.argv[1]) and '.venv' not in path:\n"
        "        files.setdefault(os.path.realpath(path), []).append(name)\n"
        "twice = {path: names for path, names in files.items() if len(names) > 1}\n"
        "print(len(files)); assert not twice, twice\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(ROOT) + os.sep], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 100  # the stages' modules were reached through the links


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


CODE = ("etagent",) + FOLDERS


def _functions(node, where: str, prefix: str, sizes: dict) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            _functions(child, where, f"{prefix}{child.name}.", sizes)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = child.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            sizes[f"{where}:{prefix}{child.name}"] = (child.end_lineno - child.lineno + 1, len(names))
            _functions(child, where, f"{prefix}{child.name}.", sizes)


def function_sizes() -> dict[str, tuple[int, int]]:
    """Every function of the project's code (tests aside), ``path:Qualified.name`` -> (lines,
    parameters without self and cls); a stage's files once, by their folder's path."""
    sizes: dict[str, tuple[int, int]] = {}
    for folder in CODE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = path.relative_to(ROOT)
            if any((ROOT / parent).is_symlink() for parent in where.parents):
                continue
            _functions(ast.parse(path.read_text(), filename=str(path)), str(where), "", sizes)
    return sizes


def test_no_function_is_longer_than_80_lines_or_takes_more_than_7_parameters_but_those_the_docs_list():
    sizes = function_sizes()
    assert len(sizes) > 500 and "rl/actor.py:update" in sizes
    over = {name for name, (lines, parameters) in sizes.items() if lines > 80 or parameters > 7}
    section = (ROOT / "docs" / "development.md").read_text().split("## Function size", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([\w/.]+\.py:[\w.]+)`", section))
    assert over - listed == set(), "over 80 lines or 7 parameters: shorten them, or list them with a reason in docs/development.md"
    assert listed - over == set(), "listed in docs/development.md but within the limits now: drop them from the list"
