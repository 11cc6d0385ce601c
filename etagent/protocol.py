"""The tool-integrated reasoning (TIR) text protocol, shared by every stage.

A trajectory is one assistant turn written in tags:

    <think> ... </think>
    <search> query </search> <result> ... </result>      (zero or more tool rounds,
    <python> code </python>  <result> ... </result>       python or search)
    <think> ... </think>
    <answer> The final answer is \\[ \\boxed{X} \\] </answer>

This module owns everything about that text: the system prompt, the stop strings, how a generated
segment becomes a tool call or an answer, how a tool result is inserted, tool-call counting,
format validation and answer extraction. Every stage (flywheel, SFT, direct rollout, RL,
evaluation, radar) uses these functions; none re-implements them.

Deliberate differences from the paper's code (see docs/paper-code.md §A1):
- One system prompt with single braces everywhere (the reference's flywheel and direct-rollout
  copies show the model a literal ``\\boxed{{}}``).
- One result format, :func:`format_result`, for data generation, SFT and RL (the reference
  inserts ``<result>x</result>`` in the flywheel and `` <result>\\nx\\n</result>`` in RL).
- A generated segment is read only up to the first ``<result>`` it contains: a policy segment
  never legitimately writes a result, so anything after one is a hallucinated tool output.

What this module does not do: tokenization (see ``etagent.agent``), running tools
(``etagent.tools``) or scoring answers (``etagent.scoring``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK, SEARCH, PYTHON, RESULT, ANSWER = "think", "search", "python", "result", "answer"
TAGS = (THINK, SEARCH, PYTHON, RESULT, ANSWER)
TOOLS = (PYTHON, SEARCH)
# Every opening and closing tag, in a fixed order (tokenizers of the toy model add these).
TAG_STRINGS = tuple(s for tag in TAGS for s in (f"<{tag}>", f"</{tag}>"))

# Stop strings the engine enforces while generating. A segment ends at a tool's closing tag (the
# loop then runs the tool) or at the end of the answer. EOS also ends a segment.
TOOL_STOPS = ("</python>", "</search>")
ANSWER_STOP = "</answer>"
STOP_STRINGS = TOOL_STOPS + (ANSWER_STOP,)

SYSTEM_PROMPT = r"""You are a helpful assistant that answers questions by reasoning step by step. You have two tools: a Wikipedia search engine and a Python interpreter.
Reason first, then answer. Put your reasoning inside <think> </think>.
To look something up, write a search query inside <search> </search>. To compute something, write Python code inside <python> </python> and print the values you need.
The output of every tool call is given back to you inside <result> </result>.
Put the final answer inside <answer> </answer>, written as: The final answer is \[ \boxed{answer here} \]

For example:
<think> This is my reasoning. </think>
<search> search query </search>
<result> search results </result>
<think> This is my reasoning. </think>
<python> Python code </python>
<result> interpreter output </result>
<think> This is my reasoning. </think>
<answer> The final answer is \[ \boxed{answer here} \] </answer>

Give the exact final answer inside \boxed{} in LaTeX format."""


def prompt_messages(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """The chat messages every stage renders for a question: the protocol in the system turn."""
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def encode_prompt(tokenizer, question: str, system_prompt: str = SYSTEM_PROMPT) -> list[int]:
    """Prompt token ids for a question, rendered with the model's chat template.

    This is the one rendering used at rollout, SFT and RL time, so the three agree token for
    token. The assistant turn is opened (``add_generation_prompt``) and the whole trajectory is
    then generated inside it; tool results never become separate chat messages.
    """
    ids = tokenizer.apply_chat_template(
        prompt_messages(question, system_prompt),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)


def format_result(output: str) -> str:
    """The text inserted after a tool call: its output wrapped in result tags.

    The one result format of the toolkit. The agent loop tokenizes this string on its own and
    appends it with mask 0; SFT masks the same span.
    """
    return f"<result>\n{output}\n</result>"


def unwrap_result(span: str) -> str | None:
    """The output a ``<result>...</result>`` span wraps, if :func:`format_result` made it (None
    for a span wrapped some other way, as imported data may have it)."""
    inner = span[len("<result>\n") : -len("\n</result>")]
    return inner if len(span) >= len("<result>\n\n</result>") and format_result(inner) == span else None


# ---------------------------------------------------------------------------------------------
# Parsing a generated segment


@dataclass(frozen=True)
class ToolCall:
    """A tool call found at the end of a generated segment."""

    tool: str  # "python" or "search"
    input: str  # the code or query, stripped; "" when the tags are empty or unopened


@dataclass(frozen=True)
class FinalAnswer:
    """A segment that ends the trajectory with ``</answer>``."""

    prediction: str  # the extracted answer (see extract_answer)


def parse_segment(segment: str) -> ToolCall | FinalAnswer | None:
    """Read one generated segment: a tool call, a final answer, or neither.

    The segment is read up to the first ``<result>`` (anything after it was not produced by a
    tool) and then up to its earliest closing tag among ``</python>``, ``</search>`` and
    ``</answer>``; with engine-side stops that tag is the segment's end. A tool's input is the
    text between the last opening tag before that closing tag and the closing tag (so
    ``<python>a<python>b</python>`` runs ``b``). Returns None when the segment holds no complete
    call or answer (it ended at EOS or the length limit).
    """
    cut = segment.find("<result>")
    text = segment if cut < 0 else segment[:cut]
    ends = [(text.find(stop), stop) for stop in STOP_STRINGS if stop in text]
    if not ends:
        return None
    end, stop = min(ends)
    if stop == ANSWER_STOP:
        return FinalAnswer(extract_answer(text[: end + len(stop)]))
    tool = stop[2:-1]
    start = text.rfind(f"<{tool}>", 0, end)
    body = "" if start < 0 else text[start + len(tool) + 2 : end]
    return ToolCall(tool, body.strip())


def cut_at_stop(text: str) -> str:
    """Cut text right after its earliest stop string (kept). Used only where text arrives from a
    server that could not enforce stops; the engines enforce them while generating."""
    ends = [text.find(s) + len(s) for s in STOP_STRINGS if s in text]
    return text[: min(ends)] if ends else text


# ---------------------------------------------------------------------------------------------
# Counting and validating


def count_valid_tags(text: str, tag: str) -> int:
    """Number of non-overlapping ``<tag>...</tag>`` pairs, scanning left to right.

    The reference's counting: find the next opening tag, then the first closing tag after it;
    count one pair and continue after the closing tag. Tags inside results are counted too.
    """
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    count, pos = 0, 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            return count
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return count
        count += 1
        pos = end + len(close_tag)


def count_tool_calls(text: str) -> int:
    """Tool calls in a trajectory's text: paired search tags plus paired python tags.

    This is the count the paper's tables, the flywheel ranking and the RL efficiency reward use.
    It counts tags written in the text, so it includes calls that were never executed and tags
    that appear inside results; the agent loop's tool-call records count executed calls.
    """
    return count_valid_tags(text, SEARCH) + count_valid_tags(text, PYTHON)


def format_problems(text: str) -> list[str]:
    """Why a trajectory breaks the reference's format rules (empty list: it follows them).

    The reference's ``validate_format``, behaviour for behaviour (the RL reward's paper mode must
    equal it on every text):
    - as many ``<think>`` as ``</think>``, at least one;
    - exactly one ``<answer>`` and one ``</answer>``, the opening tag first, and the answer
      (from its opening tag on) contains ``\\boxed{`` and ``}``;
    - for every ``<search>`` (and every ``<python>``) not inside an earlier call's span: the next
      ``</search>``, the next ``<result>`` and the ``</result>`` after that, each looked up from
      the opening tag, come in that order. A call missing its closing tag therefore borrows the
      next call's, which comes after a ``<result>``, and fails. The scan goes on from that
      ``</result>``, so a tag inside an earlier result is not checked.
    Text outside tags is allowed, the text need not start with ``<think>``, and the number of
    boxes is not limited; see :func:`template_problems` for the stricter SFT rule.
    """
    problems = []
    n_open, n_close = text.count("<think>"), text.count("</think>")
    if n_open == 0:
        problems.append("no <think>")
    if n_open != n_close:
        problems.append(f"{n_open} <think> but {n_close} </think>")
    n_answer_open, n_answer_close = text.count("<answer>"), text.count("</answer>")
    if n_answer_open != 1 or n_answer_close != 1:
        problems.append(f"{n_answer_open} <answer> and {n_answer_close} </answer> (need exactly one each)")
    else:
        start, end = text.find("<answer>"), text.find("</answer>")
        if start > end:
            problems.append("</answer> before <answer>")
        elif "\\boxed{" not in text[start:end] or "}" not in text[start:end]:
            problems.append("no \\boxed{} in the answer")
    for tool in TOOLS:
        pos = 0
        while (start := text.find(f"<{tool}>", pos)) >= 0:
            close = text.find(f"</{tool}>", start)
            result = text.find("<result>", start)
            result_end = text.find("</result>", result) if result >= 0 else -1
            if min(close, result, result_end) < 0:
                problems.append(f"<{tool}> at offset {start} is not followed by </{tool}> <result> </result>")
                break
            if result < close:
                problems.append(f"<{tool}> at offset {start}: a <result> comes before the next </{tool}>")
                break
            pos = result_end
    return problems


def validate_format(text: str) -> bool:
    """True when the trajectory follows the reference's format rules (see format_problems)."""
    return not format_problems(text)


def template_problems(text: str) -> list[str]:
    """format_problems plus the stricter rules used to filter SFT data.

    On top of the format rules, the stripped text must start with ``<think>`` and end with
    ``</answer>``, the answer must hold exactly one ``\\boxed{``, and no think, python or search
    tag may appear inside the answer.
    """
    problems = format_problems(text)
    stripped = text.strip()
    if not stripped.startswith("<think>"):
        problems.append("does not start with <think>")
    if not stripped.endswith("</answer>"):
        problems.append("does not end with </answer>")
    start, end = stripped.rfind("<answer>"), stripped.rfind("</answer>")
    if 0 <= start < end:
        answer = stripped[start:end]
        n_boxes = answer.count("\\boxed{")
        if n_boxes != 1:
            problems.append(f"{n_boxes} \\boxed{{ in the answer (need exactly one)")
        inner = [t for t in ("<think>", "</think>", "<python>", "</python>", "<search>", "</search>") if t in answer]
        if inner:
            problems.append(f"tags inside the answer: {' '.join(inner)}")
    return problems


def validate_template_format(text: str) -> bool:
    """True when the trajectory passes the stricter SFT template rules (see template_problems)."""
    return not template_problems(text)


# ---------------------------------------------------------------------------------------------
# Answer extraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _matching_brace(text: str, open_pos: int) -> int:
    """Index of the brace closing the one at open_pos, or -1 when unbalanced."""
    depth = 0
    for i in range(open_pos, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in text, brace-matched.

    Also reads the brace-less form ``\\boxed 5`` (content up to the next ``$`` or end). Returns
    None when there is no box or its braces never close.
    """
    pos = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if pos < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, pos))
    rest = pos + len(cmd)
    if text.startswith(" ", rest):
        return text[rest + 1 :].split("$")[0].strip()
    if not text.startswith("{", rest):
        return None
    close = _matching_brace(text, rest)
    return None if close < 0 else text[rest + 1 : close]


def unwrap_text(answer: str) -> str:
    """``\\text{Y}`` -> ``Y`` when the whole answer is one ``\\text{...}`` group."""
    stripped = answer.strip()
    while stripped.startswith("\\text{") and _matching_brace(stripped, 5) == len(stripped) - 1:
        stripped = stripped[6:-1].strip()
    return stripped


def extract_answer(text: str) -> str:
    """The predicted answer of a trajectory.

    Take the content between the last ``</answer>`` and the last ``<answer>`` before it; inside
    it, the last ``\\boxed{}`` (brace-matched, ``\\text{}`` unwrapped), or the whole answer
    content when it has no box. Without an answer block (or with an empty one), the last
    ``\\boxed{}`` anywhere in the text; failing that, "".
    """
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    if start >= 0 and text[start + len("<answer>") : end].strip():
        content = text[start + len("<answer>") : end]
        boxed = last_boxed(content)
        return content.strip() if boxed is None else unwrap_text(boxed)
    boxed = last_boxed(text)
    return "" if boxed is None else unwrap_text(boxed)


# ---------------------------------------------------------------------------------------------
# Splitting a trajectory into what the policy wrote and what was inserted

_RESULT_SPAN = re.compile(r"<result>.*?</result>", re.DOTALL)


def split_result_segments(text: str) -> list[tuple[str, bool]]:
    """Split trajectory text into (segment, is_tool_result) pieces, in order.

    A tool-result piece is one ``<result>...</result>`` span, tags included: exactly what the
    agent loop inserts with :func:`format_result`. Everything else was written by the policy.
    The pieces concatenate back to the text. A ``<result>`` that never closes stays in the
    policy text (nothing was inserted there).
    """
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for match in _RESULT_SPAN.finditer(text):
        if match.start() > pos:
            pieces.append((text[pos : match.start()], False))
        pieces.append((match.group(0), True))
        pos = match.end()
    if pos < len(text):
        pieces.append((text[pos:], False))
    return pieces


def strip_results(text: str) -> str:
    """The trajectory without its tool-result spans: the text the policy wrote."""
    return "".join(piece for piece, is_result in split_result_segments(text) if not is_result)


def tool_results(text: str) -> list[str]:
    """The contents of every ``<result>...</result>`` span, stripped, in order."""
    return [piece[len("<result>") : -len("</result>")].strip() for piece, is_result in split_result_segments(text) if is_result]
