"""The flywheel's prompts for the editor, the self-reflector and the summariser, and its hints.

Written from the reference's intent (docs/paper-code.md §A2.6), not copied: each prompt says what
the role must do and the exact reply format the parser in :mod:`etagent.flywheel.steps` reads. Steps are
shown as ``#### Step i: <text>`` blocks, 1-indexed, as the reference shows them.
"""

from __future__ import annotations

REDUNDANCY_PROMPT = """Below is a question and a correct solution written as numbered steps. Each step reasons inside <think> </think> and may call a tool (<search> </search> or <python> </python>) whose output follows inside <result> </result>; the last step gives the answer inside <answer> </answer>.

Find the FIRST redundant step. A step is redundant if
- its reasoning is verbose, needlessly complex or repeats earlier reasoning, or
- its tool call is unnecessary: the information is already available, or it repeats an earlier call.

If no step is redundant, reply with exactly:
Step: no

Otherwise reply with exactly three lines:
Step: <the step number>
Analysis: <why the step is redundant, in one paragraph>
Corrected Step: <the simplified step, in the same tag format: <think> ... </think> followed by at most one tool call or the final answer; never write a <result>>

Question: {question}

{steps}"""

REWRITE_PROMPT = """Below is a question and a solution. Rewrite ONLY the reasoning inside each <think> </think>: make it concise and correct, removing redundancy, mistakes and repetition. Never add, remove, reorder or change any tag, search query, Python code, tool result or the answer: they are kept exactly as they are and given to you again after each reasoning block you write.

Question: {question}

Solution:
{trajectory}"""

FLAW_PROMPT = """Below is a question and a solution written as numbered steps that reaches a WRONG answer. Each step reasons inside <think> </think> and may call a tool (<search> </search> or <python> </python>) whose output follows inside <result> </result>.

Find the FIRST step with flawed reasoning (a logical error, overthinking) or an improper tool call (a redundant call, an unsuitable tool, a wrong input, or a missing tool call where one was needed).

Reply with exactly two lines:
Step: <the step number>
Analysis: <what is wrong with the step and how to fix it, in one plain paragraph>

Question: {question}

{steps}"""

NEW_STEP_PROMPT = """Below is a question, the first steps of your own solution, and an analysis of what was wrong with your last step.

Write the corrected replacement of that last step: one line in the tag format, <think> your reasoning </think> followed by one tool call (<search> query </search> or <python> code </python>) or by the final answer <answer> The final answer is \\[ \\boxed{{answer}} \\] </answer>. Write nothing else; never write a <result>.

Question: {question}

{steps}

Analysis of the last step: {analysis}

Corrected last step:"""

# The reflector continues from this, on the flaw prompt over the steps up to the flawed one.
ANALYSIS_PREFILL = "Step: {step}\nAnalysis: Let me analyze this step."

SUMMARY_PROMPT = """You help someone answer a question by reading search results.

Search query: {query}

Search results:
{documents}

Extract the information from the search results that is relevant to the query, keeping names, dates and numbers exactly as written. Start your reply with **Final Information** and then give only that information."""

# "Use a tool" hints (B2, B3): a whole sentence, chosen per trajectory with a seeded draw. Math
# questions are nudged towards Python, the others towards search.
PYTHON_HINTS = (
    "Wait, I may have made a mistake here; perhaps I should use Python tools to compute this and rethink.",
    "Wait, this calculation is error-prone; perhaps I should use Python tools to check it and rethink.",
    "Wait, I should not do this in my head; perhaps I should use Python tools and rethink the steps.",
    "Wait, let me double-check; perhaps I should use Python tools to verify the numbers and rethink.",
    "Wait, my reasoning may be wrong; perhaps I should use Python tools to work it out and rethink.",
    "Wait, I am not sure about this result; perhaps I should use Python tools and rethink the problem.",
)
SEARCH_HINTS = (
    "Wait, I may be missing information; I should rethink and launch a new search.",
    "Wait, I am not sure this is right; I should rethink and search for the missing facts.",
    "Wait, the information so far may not be enough; I should rethink and launch a new query.",
    "Wait, I should not rely on my memory here; I should rethink and search for it.",
    "Wait, let me verify this; I should rethink and launch a new search to confirm the facts.",
    "Wait, this answer may be wrong; I should rethink and launch a new query for the key fact.",
)


def hints_for(kind: str) -> tuple[str, ...]:
    """The hint sentences for a question of this kind (math: Python, otherwise: search)."""
    return PYTHON_HINTS if kind == "math" else SEARCH_HINTS
