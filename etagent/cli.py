"""The core's own commands, ``etagent score``, ``etagent tool`` and ``etagent convert`` (the
``etagent`` command itself, which also reaches every stage, is :mod:`etagent.launcher.main`, outside the
core): scoring predictions given as JSON lines, one tool call through the configured tool, and
questions from another project's format written in ours."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import IO

from etagent import scoring
from etagent.errors import MissingInput, SettingError, exit_on_user_error


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
    parser.add_argument("--judge-temperature", type=float, default=0.0, help="the judge's sampling temperature (default 0: greedy)")
    parser.add_argument("--judge-max-new-tokens", type=int, default=16, help="tokens per verdict (default 16)")
    args = parser.parse_args(argv)
    judge = None
    if args.judge_url:
        if not args.judge_model:
            parser.error("--judge-url needs --judge-model")
        from etagent.llm import Sampling
        from etagent.llm.openai_engine import OpenAIEngine
        from etagent.llm.text import TextModel

        served = OpenAIEngine([args.judge_url], args.judge_model, api_key_env=args.judge_api_key_env)
        from etagent.errors import SettingError
        from etagent.settings import validate

        try:  # the flags are the judge's sampling settings: the same declaration checks them
            validate(Sampling, {"temperature": args.judge_temperature})
        except SettingError as error:
            raise SettingError(f"--judge-{error.key}", error.reason) from None
        if args.judge_max_new_tokens < 1:
            raise SettingError("--judge-max-new-tokens", f"must be an integer >= 1, got {args.judge_max_new_tokens}")
        sampling = Sampling.at(temperature=args.judge_temperature)
        judge = scoring.LLMJudge(TextModel(served, sampling, args.judge_max_new_tokens, "judge"))
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
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. tools.python.limits.timeout_s=5")
    args, extra = parser.parse_known_args(argv)
    overrides = list(args.overrides) + extra
    if args.tool == "python" and args.file and "=" in args.file:  # an override, not a file
        overrides.insert(0, args.file)
        args.file = None
    from etagent.config import load_settings
    from etagent.protocol import ToolCall
    from etagent.tools.executor import build_executor

    cfg = load_settings("tools", args.preset, overrides)
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


@exit_on_user_error
def convert_main(argv: list[str]) -> int:
    """``etagent convert SOURCE OUT``: questions in any format etagent.question_formats reads,
    written in our schema (JSONL), saying which column each field came from."""
    from etagent.question_formats import MAPPABLE, QuestionFormat, read_question_rows
    from etagent.records import write_jsonl

    parser = argparse.ArgumentParser(
        prog="etagent convert",
        description="Write questions in etagent's schema ({id, question, answer, source, kind}, docs/data.md) from a file in "
        "another format: ours, FlashRAG JSONL, Search-R1 or verl parquet/JSONL, a TRL prompt dataset, a `datasets` "
        "save_to_disk folder, or hf:<hub id>.",
    )
    parser.add_argument("source", help="the file, folder or hf:<hub id> to read")
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument(
        "--kind",
        choices=("auto", "math", "qa"),
        default="auto",
        help="how answers are scored (auto: each row's kind, ability or known data_source, else inferred from its answer)",
    )
    parser.add_argument(
        "--source-name", default=None, help="every question's source (default: the row's source or data_source, else the file's name)"
    )
    parser.add_argument(
        "--split", default=None, help="the split to read of a source with several (a `datasets` folder, train/test parquet files, a hub id)"
    )
    parser.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="OURS=THEIRS",
        help=f"read a field ({', '.join(MAPPABLE)}) from a column (dotted for nested ones)",
    )
    args = parser.parse_args(argv)
    fields = {}
    for item in args.field:
        ours, sep, theirs = item.partition("=")
        if not sep or not theirs:
            parser.error(f"--field {item!r}: expected OURS=THEIRS, e.g. --field question=problem")
        fields[ours] = theirs
    out = Path(args.out)
    if not args.source.startswith("hf:") and _overlaps(out, Path(args.source)):
        raise SettingError(
            "out", f"{args.out!r} is or lies inside the source {args.source!r}: outputs never overwrite inputs; write elsewhere"
        )
    settings = QuestionFormat(kind=args.kind, source=args.source_name, split=args.split, fields=fields)
    rows, mapping = read_question_rows(args.source, settings)
    write_jsonl(out, [row.question for row in rows])
    print(f"wrote {len(rows)} questions to {out}")
    print(f"read {args.source}: {mapping.describe()}")
    return 0


def _overlaps(out: Path, source: Path) -> bool:
    out, source = out.resolve(), source.resolve()
    return out == source or source in out.parents
