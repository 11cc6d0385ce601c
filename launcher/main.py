"""The ``etagent`` command: one subcommand per stage and a few utilities.

    etagent toy build --out runs/toy [overrides]   build the toy world and tiny model
    etagent retriever build|serve [overrides]      index a corpus / serve it (retriever/)
    etagent flywheel [--preset P] [overrides]      evolve seed questions into trajectories (flywheel/run.py)
    etagent flywheel export [--preset P] [...]     the flywheel's trajectories as SFT data (flywheel/export.py)
    etagent direct-rollout [--preset P] [overrides] K chains per question for RL (direct_rollout/run.py)
    etagent pareto [--preset P] [overrides]        choose a stage's RL questions (pareto/run.py)
    etagent sft [--preset P] [overrides]           fine-tune on trajectories (sft/run.py)
    etagent rl [--preset P] [overrides]            GRPO with the efficiency reward (rl/run.py)
    etagent evaluate [--preset P] [overrides]      benchmarks and the paper's table (evaluation/run.py)
    etagent radar [--preset P] [overrides]         radar metrics and chart (radar/run.py)
    etagent report RUN_DIR [--out FILE] [--max-trajectories N]  a run's report page (report/run.py)
    etagent score [FILE] [--judge-url URL ...]     score predictions, one JSON line each
    etagent reward [FILE]                          the RL efficiency reward of groups, one JSON line each (rl/reward.py)
    etagent tool python|search ...                 run one tool call, print its record
    etagent convert SOURCE OUT [--kind K ...]      questions from another project's format, in ours
    etagent configs [--check]                      write every preset, resolved, into configs/resolved/

Stage commands take ``--preset NAME`` (``configs/<stage>/NAME.yaml``, default ``tiny``), Hydra
overrides (``key=value``), ``--cfg job``, ``--info``, ``-m`` sweeps and ``--help`` (every setting
with its doc); each also runs as ``python -m <module>``.
"""

# A stage is imported only when its command runs (``etagent score`` does not load torch), by an
# import statement in its command's function, so that tests/test_layout.py sees which modules the
# launcher reaches.

from __future__ import annotations

import sys
from collections.abc import Callable


def register_stage_schemas() -> None:
    """Every stage's config schema (its package registers it when imported; the shared groups'
    are registered by the modules that read them, which the stages import), for ``etagent configs``."""
    import etagent.direct_rollout  # noqa: F401
    import etagent.evaluation  # noqa: F401
    import etagent.flywheel  # noqa: F401
    import etagent.pareto  # noqa: F401
    import etagent.radar  # noqa: F401
    import etagent.retriever  # noqa: F401
    import etagent.rl  # noqa: F401
    import etagent.sft  # noqa: F401
    import etagent.toy.config  # noqa: F401


def toy(argv: list[str]) -> None:
    from etagent.toy.build import main

    main(argv)


def retriever_build(argv: list[str]) -> None:
    from etagent.retriever.build import main

    main(argv)


def retriever_serve(argv: list[str]) -> None:
    from etagent.retriever.server import main

    main(argv)


def flywheel_export(argv: list[str]) -> None:
    from etagent.flywheel.export import main

    main(argv)


def flywheel(argv: list[str]) -> None:
    from etagent.flywheel.run import main

    main(argv)


def direct_rollout(argv: list[str]) -> None:
    from etagent.direct_rollout.run import main

    main(argv)


def pareto(argv: list[str]) -> None:
    from etagent.pareto.run import main

    main(argv)


def sft(argv: list[str]) -> None:
    from etagent.sft.run import main

    main(argv)


def rl(argv: list[str]) -> None:
    from etagent.rl.run import main

    main(argv)


def evaluate(argv: list[str]) -> None:
    from etagent.evaluation.run import main

    main(argv)


def reward(argv: list[str]) -> None:
    from etagent.rl.reward import main

    main(argv)


def radar(argv: list[str]) -> None:
    from etagent.radar.run import main

    main(argv)


def report(argv: list[str]) -> None:
    from etagent.report.run import main

    main(argv)


# command: (the sub-command it requires or None, what runs it, help)
STAGES: dict[str, tuple[str | None, Callable[[list[str]], None], str]] = {
    "toy": ("build", toy, "build the toy world and tiny model: etagent toy build --out DIR"),
    "retriever build": (None, retriever_build, "index a corpus: etagent retriever build [overrides]"),
    "retriever serve": (None, retriever_serve, "serve an index: etagent retriever serve [overrides]"),
    "flywheel export": (None, flywheel_export, "the flywheel's trajectories as SFT data: etagent flywheel export [--preset P] [overrides]"),
    "flywheel": (None, flywheel, "evolve seed questions into judged trajectories: etagent flywheel [--preset P] [overrides]"),
    "direct-rollout": (
        None,
        direct_rollout,
        "K judged chains per question with the policy: etagent direct-rollout [--preset P] [overrides]",
    ),
    "pareto": (None, pareto, "Pareto selection of a stage's RL questions into rl.parquet: etagent pareto [--preset P] [overrides]"),
    "sft": (None, sft, "fine-tune on trajectories with tool results masked: etagent sft [--preset P] [overrides]"),
    "rl": (None, rl, "GRPO with the efficiency reward on a stage's rl.parquet: etagent rl [--preset P] [overrides]"),
    "evaluate": (None, evaluate, "benchmarks, metrics and the paper's table: etagent evaluate [--preset P] [overrides]"),
    "reward": (None, reward, "the RL efficiency reward of groups given as JSON lines: etagent reward [FILE]"),
    "radar": (None, radar, "radar metrics and chart over evaluation runs: etagent radar [--preset P] [overrides]"),
    "report": (None, report, "one self-contained HTML page of a run: etagent report RUN_DIR [--out FILE]"),
}
UTILITIES = {
    "score": "score predictions given as JSON lines",
    "tool": "run one tool call (python or search) with the tools config",
    "convert": "questions from another format (FlashRAG, Search-R1, verl, TRL, datasets) in ours: etagent convert SOURCE OUT",
    "configs": "write every preset, resolved, into configs/resolved/ (--check: fail if one is stale)",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    two_words = " ".join(argv[:2])
    name = two_words if two_words in STAGES else (argv[0] if argv else "")
    if name in STAGES:
        sub, command, _ = STAGES[name]
        rest = argv[len(name.split()) :]
        if sub is not None:
            if not rest or rest[0] != sub:
                print(f"usage: etagent {name} {sub} ...", file=sys.stderr)
                return 2
            rest = rest[1:]
        command(rest)
        return 0
    if name == "tool":
        from etagent.cli import tool_main

        return tool_main(argv[1:])
    if name == "score":
        from etagent.cli import score_main

        return score_main(argv[1:])
    if name == "convert":
        from etagent.cli import convert_main

        return convert_main(argv[1:])
    if name == "configs":
        register_stage_schemas()
        from etagent.config import configs_main

        return configs_main(argv[1:])
    print(__doc__.strip())
    print("\ncommands:")
    for command_name, (_, _, help_text) in STAGES.items():
        print(f"  {command_name:<16} {help_text}")
    for command_name, help_text in UTILITIES.items():
        print(f"  {command_name:<16} {help_text}")
    return 0 if not argv or argv[0] in ("-h", "--help") else 2
