"""The documentation holds together: pure file reading, no fixtures.

- README.md is at most 250 lines and starts with the title and the two commands for a fresh
  machine (`make demo`, `make test`);
- every relative link and image in README.md, docs/*.md and the folders' README.md files points
  at a file or folder that exists (anchors are not checked; http(s) and mailto links are skipped);
- no tracked text file points outside the repository at the reference notes (they are
  docs/paper-code.md now);
- every page in docs/ is linked from README.md.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    folders = [p for p in ROOT.glob("*/README.md") if not p.parent.name.startswith(".")]
    return [README, *sorted((ROOT / "docs").glob("*.md")), *sorted(folders)]


def links(path: Path) -> list[str]:
    """The link targets in a markdown file, outside code blocks and inline code."""
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    return LINK.findall(text)


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    assert lines[0].startswith("# ")
    start = next(i for i, line in enumerate(lines) if line.strip())  # the title
    block = lines[start + 1 :]
    block = block[next(i for i, line in enumerate(block) if line.strip()) :]  # the first thing after it
    assert block[0] == "```bash", "the first thing after the title must be the commands' bash block"
    commands = block[1 : block.index("```", 1)]
    assert [c.split("#")[0].strip() for c in commands] == ["make demo", "make test"]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"(https?|mailto):", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_nothing_points_outside_the_repository():
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "*.md", "*.py", "*.yaml", "*.sh"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    # the notes the docs were written from, by path or by name (spelt so that this file does not match)
    outside = ("../" + "shared", "shared" + "/reference", "paper_" + "rl.md", "paper_" + "data_stages.md", "paper_" + "eval_radar")
    offenders = [
        name for name in tracked if (ROOT / name).is_file() and any(s in (ROOT / name).read_text(errors="replace") for s in outside)
    ]
    assert not offenders, f"files that point outside the repository (use docs/paper-code.md): {offenders}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.split("#")[0]).resolve() for target in links(README)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


# ---------------------------------------------------------------------------------------------
# Every command in the docs' code blocks


# a stage's config folder for each way the docs launch it
CONFIG_OF = {
    "etagent.retriever.build": "retriever",
    "etagent.retriever.server": "retriever",
    "etagent.flywheel.run": "flywheel",
    "etagent.flywheel.export": "flywheel",
    "etagent.direct_rollout.run": "direct_rollout",
    "etagent.pareto.run": "pareto",
    "etagent.sft.run": "sft",
    "etagent.rl.run": "rl",
    "etagent.evaluation.run": "evaluation",
    "etagent.radar.run": "radar",
    "scripts/sft.sh": "sft",
    "scripts/rl.sh": "rl",
}


def documented_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every command line in a bash code block of README.md and docs/*.md, with
    continuation lines joined, comments and leading VAR=value assignments dropped."""
    import shlex

    commands = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```", page.read_text(), re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:  # a line of a multi-line string (a here-document, python -c): not a command
                    continue
                while words and re.match(r"^[A-Z_]+=", words[0]):
                    words.pop(0)
                if words:
                    commands.append((page.name, words))
    return commands


def check_command(words: list[str]) -> str | None:
    """What is wrong with one documented command, or None: the script, bench, make target,
    `etagent` command or module exists, and a stage's settings load with its preset and
    overrides (every key a declared setting, every value of its type and range)."""
    from etagent.config import load_config
    from etagent.launcher.main import STAGES, UTILITIES

    if words[0] == "make":
        targets = re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M)
        return None if words[1] in targets else f"no make target {words[1]}"
    if words[0] == "etagent":
        known = words[1] in UTILITIES or words[1] in STAGES or " ".join(words[1:3]) in STAGES
        return None if known else f"no etagent command {words[1]}"
    if words[0] in ("python", "torchrun") and "-m" in words:
        target, args = words[words.index("-m") + 1], words[words.index("-m") + 2 :]
        if not target.startswith("etagent"):
            return None  # pip, torch.distributed.run, a peer's trainer: not ours
        if not (ROOT / (target.removeprefix("etagent.").replace(".", "/") + ".py")).exists() and target != "etagent.launcher":
            return f"no module {target}"
    elif words[0] in ("python", "bash"):
        target, args = words[1], words[2:]
        if not (ROOT / target).is_file():
            return f"no file {target}"
    else:
        return None  # pip, cd, git, ...: not ours
    stage = CONFIG_OF.get(target)
    if stage is None:
        return None
    preset = args[args.index("--preset") + 1] if "--preset" in args else "tiny"
    overrides = [a for a in args if "=" in a and not a.startswith("-") and a != "..."]
    try:
        load_config(stage, preset, overrides)
    except Exception as error:  # the message names the setting
        return f"{type(error).__name__}: {error}"
    return None


def test_every_command_in_the_docs_names_what_exists_and_loads_its_settings():
    """Each command line in the README's and docs/'s bash blocks: its script, module, make target
    or `etagent` command exists, and a stage's preset and overrides load (a renamed setting, a
    removed preset or a value out of range fails here). What the commands compute is the demo's
    and the stages' tests' to check."""
    import etagent.direct_rollout  # noqa: F401  (each stage package registers its schema)
    import etagent.evaluation  # noqa: F401
    import etagent.flywheel  # noqa: F401
    import etagent.pareto  # noqa: F401
    import etagent.radar  # noqa: F401
    import etagent.retriever  # noqa: F401
    import etagent.rl  # noqa: F401
    import etagent.sft  # noqa: F401

    commands = documented_commands()
    assert len(commands) > 30
    wrong = [f"{page}: {' '.join(words)}\n    {problem}" for page, words in commands if (problem := check_command(words))]
    assert not wrong, "documented commands that would fail:\n" + "\n".join(wrong)


def program(words: list[str]) -> str | None:
    """The program a documented command runs, named as the demo's scripts and the tests call it:
    ``make demo``, a script's path, a module (``etagent <stage>`` is the stage's module, which
    the launcher runs with the same arguments), an ``etagent`` utility; None when it is not ours
    (pip, a peer's trainer, a shell line)."""
    if words[0] == "make":
        return f"make {words[1]}"
    if words[0] == "etagent":
        return LAUNCHED.get(words[1], f"etagent {words[1]}")
    if words[0] in ("python", "torchrun") and "-m" in words:
        module = words[words.index("-m") + 1]
        return module if module.startswith("etagent") else None
    if words[0] in ("python", "bash"):
        return words[1]
    return None


# the stages the docs launch with `etagent <stage>`, and the module it runs
LAUNCHED = {
    "direct-rollout": "etagent.direct_rollout.run",
    "evaluate": "etagent.evaluation.run",
    "rl": "etagent.rl.run",
    "report": "etagent.report.run",
    "toy": "etagent toy build",
}

# Where each documented program runs: "demo" (scripts/demo.sh or a script it runs), "ci" (.ci/run),
# or a test, whose file names the program.
RUN_BY = {
    "make demo": "demo",
    "scripts/demo.sh": "demo",  # what make demo runs (WORLD=hard runs it on the hard world)
    "make test": "ci",
    "etagent toy build": "demo",
    "etagent score": "tests/test_cli.py::test_score_writes_every_metric_per_line",
    "etagent convert": "tests/test_question_formats.py::test_convert_writes_our_schema_and_says_what_it_mapped",
    "etagent.retriever.build": "demo",
    "etagent.retriever.server": "demo",
    "scripts/retriever.sh": "tests/test_retriever.py::test_kill_9_during_build_then_rerun_gives_the_same_index",
    "scripts/flywheel.sh": "demo",
    "etagent.flywheel.run": "demo",
    "etagent.flywheel.export": "demo",
    "etagent.sft.run": "demo",
    "scripts/sft.sh": "tests/test_sft.py::test_two_process_cpu_run_trains_and_saves_a_working_model",
    "scripts/prepare_rl_stage.sh": "demo",
    "etagent.direct_rollout.run": "demo",
    "etagent.pareto.run": "demo",
    "scripts/rl.sh": "demo",
    "etagent.rl.run": "demo",
    "etagent.evaluation.run": "demo",
    "etagent.evaluation.table": "demo",
    "etagent.radar.run": "demo",
    "etagent.report.run": "demo",
    "scripts/flywheel_effect.sh": "tests/test_flywheel_run.py::test_the_toy_flywheel_end_to_end_and_its_data_feeds_sft",
    "scripts/partial_effect.sh": "tests/test_curriculum.py::test_curriculum_chains_stages_and_resumes",
    "examples/openai_harness.py": "tests/test_gateway.py::test_the_example_harness_drives_the_trained_toy_policy_through_the_gateway",
    "etagent.evaluation.ablations": "tests/test_ablations.py::test_the_command_writes_both_files_and_refuses_a_missing_directory",
}
# Documented programs nothing here runs, and why.
NOT_RUN_HERE = {
    "scripts/check_gpu_install.sh": "resolves the GPU install against PyPI (downloads GBs of CUDA wheels' metadata)",
    "bench/gpu_acceptance.sh": "needs a CUDA GPU (its CPU-runnable items run in tests/test_benches.py)",
    "scripts/gateway_effect.sh": "runs 12 RL runs of 20 steps, half of them through the harness (about 50 minutes on 2 cores); run by hand for docs/gateway.md",
    "scripts/ablations.sh": "needs a finished demo and runs 6 curricula per seed (on the toy 3 seeds, 1.5 to 2.5 hours; on the hard world 5, with learning curves); run by hand for docs/reproducibility.md",
}


def demo_closure() -> str:
    """The text of scripts/demo.sh and of every script it runs, transitively."""
    seen, todo, text = set(), ["scripts/demo.sh"], ""
    while todo:
        script = todo.pop()
        if script in seen:
            continue
        seen.add(script)
        body = (ROOT / script).read_text()
        text += body
        todo += re.findall(r"^\s*(?:[A-Z_]+=\S+\s+)*(?:bash|source|exec bash)\s+(scripts/[\w-]+\.sh)", body, re.M)
    return text


def test_every_command_in_the_docs_is_run_by_the_demo_or_a_test():
    """Each program a command in the docs runs is run by the demo, by CI, or by a named test
    (whose file names the program), or is one of the few that cannot run on a CPU machine in a
    test's time, each with its reason: a new documented command needs one of the three."""
    demo = demo_closure()
    ci = (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    documented = {p for _, words in documented_commands() if (p := program(words))}
    unplaced = documented - set(RUN_BY) - set(NOT_RUN_HERE)
    assert not unplaced, f"documented programs that nothing runs: {sorted(unplaced)}"
    assert not set(RUN_BY) & set(NOT_RUN_HERE)
    assert set(NOT_RUN_HERE) <= documented, f"exceptions for programs no longer documented: {sorted(set(NOT_RUN_HERE) - documented)}"
    for name, where in RUN_BY.items():
        if name.startswith("make "):
            target = name.split()[1]
            recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
            assert f"scripts/{target}.sh" in recipe, name
            runner = {"demo": "scripts/demo.sh", "ci": "make test"}[where]
            assert runner in (recipe if where == "demo" else ci), name
        elif where == "demo":
            assert name in demo, f"{name}: not run by scripts/demo.sh or the scripts it runs"
        else:
            path, test = where.split("::")
            source = (ROOT / path).read_text()
            assert f"def {test}(" in source, where
            assert name.split()[-1] in source, f"{where} does not name {name}"
    for module in LAUNCHED.values():
        assert module in RUN_BY, module
