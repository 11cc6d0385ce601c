"""SFT data: chat examples to token ids and labels, with tool results masked.

An example is the protocol's system prompt, a question and one assistant turn split into
segments the policy wrote (trained) and tool results (masked). Tokenization follows the agent
loop exactly: the prompt is :func:`etagent.protocol.encode_prompt` (the same ids a rollout
starts from), each segment is tokenized on its own (as the loop appends generated segments and
tokenized results), and an EOS ends the turn. Labels are -100 on the prompt and on every
tool-result segment. Policy text the rollout did not sample (a prefix, an edited step, a hint)
is trained, as in the paper's SFT data. When an example carries the token ids and mask of the
trajectory it came from (:meth:`SFTExample.from_rollout`) and they decode to its text, those ids
are used as they are: the model is trained on exactly what was generated, and the mask agrees
with the text's result spans.

Sequences longer than ``cutoff_len`` are dropped, never truncated (truncation would cut off the
answer and teach the model to stop without one); the count is reported.

Also here: importing LLaMA-Factory alpaca and sharegpt files (the paper's SFT data), moving the
protocol prompt from the user turn, where the paper's alpaca layout put it, to the system turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from etagent import protocol
from etagent.errors import MissingInput, SettingError
from etagent.records import Message, RecordError, Segment, SFTExample, read_json_file, read_records

log = logging.getLogger(__name__)
IGNORE = -100


@dataclass
class Tokenized:
    id: str
    input_ids: list[int]
    labels: list[int]
    from_token_ids: bool  # True when the trajectory's own ids were used

    def __len__(self) -> int:
        return len(self.input_ids)


def tokenize_example(example: SFTExample, tokenizer) -> Tokenized:
    """Token ids and labels for one example (see the module docstring for the rules)."""
    system = example.system or protocol.SYSTEM_PROMPT
    prompt = protocol.encode_prompt(tokenizer, example.question, system)
    ids, mask = example.response_ids, example.response_mask  # both or neither, of one length (SFTExample checks)
    if ids is not None and tokenizer.decode(ids, skip_special_tokens=False) == example.response:
        response, response_labels, exact = list(ids), [t if m else IGNORE for t, m in zip(ids, mask)], True
    else:
        response, response_labels, exact = [], [], False
        for segment in example.segments:
            piece = list(tokenizer.encode(segment.text, add_special_tokens=False))
            response += piece
            response_labels += piece if segment.train else [IGNORE] * len(piece)
    if not response or response[-1] != tokenizer.eos_token_id:
        response.append(tokenizer.eos_token_id)  # the model learns to end its turn
        response_labels.append(tokenizer.eos_token_id)
    return Tokenized(example.id, prompt + response, [IGNORE] * len(prompt) + response_labels, exact)


def build_dataset(examples: list[SFTExample], tokenizer, cutoff_len: int) -> tuple[list[Tokenized], dict]:
    """Tokenize every example, dropping those over cutoff_len; returns the rows and a report."""
    rows, dropped, untrained = [], [], []
    for example in examples:
        row = tokenize_example(example, tokenizer)
        if len(row) > cutoff_len:
            dropped.append(example.id)
        elif not any(segment.train for segment in example.segments) or not any(label != IGNORE for label in row.labels):
            untrained.append(example.id)  # every segment masked: nothing to learn from but the end of the turn
        else:
            rows.append(row)
    report = {
        "examples": len(examples),
        "kept": len(rows),
        "dropped_over_cutoff": len(dropped),
        "dropped_all_masked": len(untrained),
        "from_token_ids": sum(r.from_token_ids for r in rows),
        "tokens": sum(len(r) for r in rows),
        "trained_tokens": sum(sum(1 for label in r.labels if label != IGNORE) for r in rows),
    }
    if untrained:
        log.warning("dropped %d of %d examples whose every segment is masked (first: %s)", len(untrained), len(examples), untrained[:3])
    if dropped:
        log.warning("dropped %d of %d examples longer than cutoff_len=%d (first: %s)", len(dropped), len(examples), cutoff_len, dropped[:3])
    return rows, report


# ---------------------------------------------------------------------------------------------
# Loading


def _example(id: str, system: str, question: str, response: str, source: str) -> SFTExample:
    example = SFTExample.from_trajectory(id, question, response, system_prompt=system)
    example.source = source
    return example


def _looks_like_protocol_prompt(text: str) -> bool:
    return all(tag in text for tag in ("<think>", "<answer>", "<result>"))


def load_alpaca(path: Path) -> list[SFTExample]:
    """LLaMA-Factory alpaca JSON: ``instruction``, ``input``, ``output``, optional ``system``.

    In the paper's data the protocol prompt is the instruction and the question the input; the
    prompt goes to the system turn here, as every other stage has it.
    """
    rows = read_json_file(path)
    if not isinstance(rows, list):
        raise RecordError(path, None, "(file)", "expected a JSON array of examples")
    out = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise RecordError(path, i, "(record)", f"expected a JSON object, got {type(row).__name__}")
        for field in ("instruction", "output"):
            if not isinstance(row.get(field), str):
                raise RecordError(path, i, field, "missing or not a string")
        instruction, question = row["instruction"], row.get("input") or ""
        system = row.get("system") or ""
        if question and (not system or _looks_like_protocol_prompt(instruction)):
            system = instruction
        elif not question:
            question = instruction
        out.append(_example(f"{path.stem}-{i}", system or protocol.SYSTEM_PROMPT, question, row["output"], "alpaca"))
    return out


def load_sharegpt(path: Path) -> list[SFTExample]:
    """LLaMA-Factory sharegpt JSON: ``conversations`` of human/gpt turns (observation turns are
    tool results, and so are ``<result>`` spans inline in a gpt turn: both masked), optional
    ``system``. One human turn, then the assistant's."""
    rows = read_json_file(path)
    if not isinstance(rows, list):
        raise RecordError(path, None, "(file)", "expected a JSON array of examples")
    out = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise RecordError(path, i, "(record)", f"expected a JSON object, got {type(row).__name__}")
        turns = row.get("conversations")
        if not isinstance(turns, list) or not turns:
            raise RecordError(path, i, "conversations", "missing or empty")
        for j, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
                raise RecordError(path, i, f"conversations.{j}", "expected an object with a string 'from' and a string 'value'")
        if turns[0].get("from") != "human":
            raise RecordError(path, i, "conversations.0.from", "the first turn must be human")
        pieces = []
        for j, turn in enumerate(turns[1:], start=1):
            role = turn.get("from")
            if role in ("gpt", "function_call"):  # results inline in a turn are masked too
                pieces += [Segment(text=text, train=not is_result) for text, is_result in protocol.split_result_segments(turn["value"])]
            elif role == "observation":  # tool output, wrapped as the agent loop wraps it
                value = turn["value"]
                whole = value.startswith("<result>") and value.endswith("</result>")
                pieces.append(Segment(text=value if whole else protocol.format_result(value), train=False))
            else:
                raise RecordError(path, i, f"conversations.{j}.from", f"{role!r} after the question (expected gpt or observation)")
        system = row.get("system") or protocol.SYSTEM_PROMPT
        response = "".join(p.text for p in pieces)
        messages = [
            Message(role="system", content=system),
            Message(role="user", content=turns[0]["value"]),
            Message(role="assistant", content=response),
        ]
        out.append(SFTExample(id=f"{path.stem}-{i}", messages=messages, segments=pieces, source="sharegpt"))
    return out


def load_examples(path: str | Path, fmt: str) -> list[SFTExample]:
    """SFT examples from ``etagent`` JSONL (SFTExample lines), ``alpaca`` or ``sharegpt`` JSON."""
    path = Path(path)
    if not path.exists():
        raise MissingInput(f"{path}: SFT data not found")
    if fmt == "etagent":
        return read_records(path, SFTExample)
    if fmt == "alpaca":
        return load_alpaca(path)
    if fmt == "sharegpt":
        return load_sharegpt(path)
    raise SettingError("data.format", f"must be etagent, alpaca or sharegpt, got {fmt!r}")
