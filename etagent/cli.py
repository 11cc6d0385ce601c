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
    etagent score [FILE] [--judge-url URL ...]     score predictions, one JSON line each
    etagent reward [FILE]                          the RL efficiency reward of groups, one JSON line each (rl/reward.py)
    etagent tool python|search ...                 run one tool call, print its record

Stage subcommands take ``--preset NAME`` (``configs/<stage>/NAME.yaml``, default ``tiny``) and
Hydra overrides (``key=value``); each also runs as ``python -m <module>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO

from etagent import scoring
from etagent.errors import MissingInput, exit_on_user_error


def _score_lines(source: IO[bytes], name: str, out: IO[str], judge: scoring.LLMJudge | None) -> int:
    """Score every JSON line of source, writing one line per input as soon as it is scored."""
    from etagent.records import RecordError, iter_json_objects

    rows = []
    for number, item in iter_json_objects(source, name):
        golds = item.get("answers", item.get("answer"))
        for field, value in (("prediction", item.get("prediction")), ("answers", golds)):
            if value is None:
                raise RecordError(name, number, field, "missing")
        golds = golds if isinstance(golds, list) else [golds]
        kind = item.get("kind", "qa")
        if kind not in ("math", "qa"):
            raise RecordError(name, number, "kind", f"must be 'math' or 'qa', got {kind!r}")
        if judge is not None and "question" not in item:
            raise RecordError(name, number, "question", "missing (the LLM judge needs it)")
        metrics = scoring.score_prediction(str(item["prediction"]), golds)
        metrics["correctness"] = scoring.rule_correctness(str(item["prediction"]), golds, kind)
        if judge is None:
            out.write(json.dumps({**item, **metrics}, ensure_ascii=False) + "\n")
            out.flush()
        else:
            rows.append((item, golds, metrics))
    if judge is not None:  # judged together, concurrently
        judge.judge_into([(metrics, item["question"], golds, str(item["prediction"])) for item, golds, metrics in rows])
        for item, _, metrics in rows:
            out.write(json.dumps({**item, **metrics}, ensure_ascii=False) + "\n")
        out.flush()
    return 0


@exit_on_user_error
def score_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="etagent score",
        description="Score predictions. Reads JSON lines {prediction, answers, kind[, question]} "
        "(answers: a string or a list; kind: math or qa, default qa) and writes each line back "
        "with every metric of etagent.scoring added.",
    )
    parser.add_argument("file", nargs="?", help="JSONL input (default: stdin)")
    parser.add_argument("--judge-url", help="OpenAI-compatible server for the LLM judge, e.g. http://127.0.0.1:8051/v1")
    parser.add_argument("--judge-model", help="model name served at --judge-url")
    parser.add_argument("--judge-api-key-env", default="ETAGENT_JUDGE_API_KEY", help="environment variable holding the judge's API key")
    args = parser.parse_args(argv)
    judge = None
    if args.judge_url:
        if not args.judge_model:
            parser.error("--judge-url needs --judge-model")
        judge = scoring.LLMJudge.connect(args.judge_url, args.judge_model, api_key_env=args.judge_api_key_env)
    if args.file:
        if not os.path.isfile(args.file):
            raise MissingInput(f"{args.file}: no such file")
        with open(args.file, "rb") as f:
            return _score_lines(f, args.file, sys.stdout, judge)
    return _score_lines(sys.stdin.buffer, "<stdin>", sys.stdout, judge)


@exit_on_user_error
def tool_main(argv: list[str]) -> int:
    """`etagent tool python|search`: one call through the configured tool, one JSON line out."""
    parser = argparse.ArgumentParser(
        prog="etagent tool",
        description="Run one tool call with the tools config and print its record as a JSON line. "
        "Examples: echo 'print(6*7)' | etagent tool python ;  etagent tool search --query 'Zorvak Telmin'",
    )
    parser.add_argument("tool", choices=["python", "search"])
    parser.add_argument("file", nargs="?", help="python: a file with the code (default: stdin)")
    parser.add_argument("--query", help="search: the query")
    parser.add_argument("--preset", default="tiny", help="configs/tools/PRESET.yaml (default: tiny)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. tools.python.timeout_s=5")
    args, extra = parser.parse_known_args(argv)
    overrides = list(args.overrides) + extra
    if args.tool == "python" and args.file and "=" in args.file:  # an override, not a file
        overrides.insert(0, args.file)
        args.file = None
    from etagent.config import load_config
    from etagent.protocol import ToolCall
    from etagent.tools.executor import build_executor

    cfg = load_config("tools", args.preset, overrides).tools
    if args.tool == "python":
        payload = open(args.file).read() if args.file else sys.stdin.read()
    else:
        if not args.query:
            parser.error("search needs --query")
        payload = args.query
    with build_executor(cfg) as executor:
        [record] = executor.run_sync([ToolCall(args.tool, payload)])
        line = record.to_json()
        if args.tool == "python":
            backend = executor.tools["python"].backend
            line["isolation"] = backend.isolation
            if backend.isolation_note:
                line["isolation_note"] = backend.isolation_note
    print(json.dumps(line, ensure_ascii=False))
    return 0 if record.ok else 1


# Stage commands: (sub-command or None, module whose main(argv) runs it, help). Each stage module
# is also runnable as `python -m <module>`.
STAGES = {
    "toy": ("build", "etagent.toy.build", "build the toy world and tiny model: etagent toy build --out DIR"),
    "retriever build": (None, "retriever.build", "index a corpus: etagent retriever build [overrides]"),
    "retriever serve": (None, "retriever.server", "serve an index: etagent retriever serve [overrides]"),
    "flywheel export": (
        None,
        "flywheel.export",
        "the flywheel's trajectories as SFT data: etagent flywheel export [--preset P] [overrides]",
    ),
    "flywheel": (None, "flywheel.run", "evolve seed questions into judged trajectories: etagent flywheel [--preset P] [overrides]"),
    "direct-rollout": (
        None,
        "direct_rollout.run",
        "K judged chains per question with the policy: etagent direct-rollout [--preset P] [overrides]",
    ),
    "pareto": (None, "pareto.run", "Pareto selection of a stage's RL questions into rl.parquet: etagent pareto [--preset P] [overrides]"),
    "sft": (None, "sft.run", "fine-tune on trajectories with tool results masked: etagent sft [--preset P] [overrides]"),
    "rl": (None, "rl.run", "GRPO with the efficiency reward on a stage's rl.parquet: etagent rl [--preset P] [overrides]"),
    "evaluate": (None, "evaluation.run", "benchmarks, metrics and the paper's table: etagent evaluate [--preset P] [overrides]"),
    "reward": (None, "rl.reward", "the RL efficiency reward of groups given as JSON lines: etagent reward [FILE]"),
    "radar": (None, "radar.run", "radar metrics and chart over evaluation runs: etagent radar [--preset P] [overrides]"),
}
UTILITIES = {
    "score": "score predictions given as JSON lines",
    "tool": "run one tool call (python or search) with the tools config",
    "configs": "write every preset, resolved, into configs/resolved/ (--check: fail if one is stale)",
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    two_words = " ".join(argv[:2])
    name = two_words if two_words in STAGES else (argv[0] if argv else "")
    if name in STAGES:
        sub, module, _ = STAGES[name]
        rest = argv[len(name.split()) :]
        if sub is not None:
            if not rest or rest[0] != sub:
                print(f"usage: etagent {name} {sub} ...", file=sys.stderr)
                return 2
            rest = rest[1:]
        importlib.import_module(module).main(rest)
        return 0
    if name == "tool":
        return tool_main(argv[1:])
    if name == "score":
        return score_main(argv[1:])
    if name == "configs":
        from etagent.config import configs_main

        return configs_main(argv[1:])
    print(__doc__.strip())
    print("\ncommands:")
    for command, (_, _, help_text) in STAGES.items():
        print(f"  {command:<16} {help_text}")
    for command, help_text in UTILITIES.items():
        print(f"  {command:<16} {help_text}")
    return 0 if not argv or argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
