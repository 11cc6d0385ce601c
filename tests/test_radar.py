"""The radar metrics (radar/): the paper's rules for a tool result and redundancy votes, the chart's
layout, the redundancy judge through a served text model, and labels that are unique and never
form a path."""

from __future__ import annotations

import json
import os

import pytest
from fastapi import FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st

from etagent.config import build, load_settings
from etagent.radar.config import RadarJudge
from etagent.radar.metrics import execution, majority_redundant, paper_result_ok, parse_redundancy
from etagent.records import Question, Trajectory
from tests.support.servers import serve


def test_radar_rules():
    assert paper_result_ok("Paris is the capital.") and not paper_result_ok("")
    assert not paper_result_ok("The page discusses error correction codes.")  # the paper's rule
    assert not paper_result_ok("Execution Timeout: stopped")
    from etagent.records import ToolCallRecord

    calls = [
        ToolCallRecord(tool="search", input="q", output="error correction codes", ok=True),
        ToolCallRecord(tool="python", input="1/0", output="ZeroDivisionError: division by zero", ok=False),
    ]
    text = "<search>q</search><result>\nerror correction codes\n</result><python>1/0</python><result>\nZeroDivisionError: division by zero\n</result>"
    assert execution(text, calls) == {"paper_total": 2, "paper_failed": 2, "corrected_total": 2, "corrected_failed": 1}
    assert parse_redundancy("<answer>Yes.</answer>") is True and parse_redundancy("no") is False
    assert parse_redundancy("maybe") is None and parse_redundancy(None) is None
    assert (
        majority_redundant([True, True, False])
        and not majority_redundant([True, False])
        and not majority_redundant([None, None, True, False])
    )


@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_the_radar_chart_has_no_text_over_text_and_none_cut_off(count, tmp_path):
    """The chart as drawn: every text's bounding box (axis names, ticks, legend lines, caption)
    inside the canvas and clear of every other; and the saved PNG's edge rows blank (nothing
    clipped at the border)."""
    from itertools import combinations

    import matplotlib.image
    from matplotlib.text import Text

    from etagent.radar.chart import AXES, draw, figure

    runs = {f"stage {k} of a long-named curriculum run": {axis: 95.0 - 9 * k for axis in AXES} for k in range(count)}
    behaviour = {label: (12.5, 3.25) for label in runs}
    fig = figure(runs, "corrected", behaviour)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert len(boxes) >= len(AXES) + count + 1  # the axis names, a legend entry per run, the caption
    for text, box in boxes:
        assert 0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height, (text, box, width, height)
    for (a, box_a), (b, box_b) in combinations(boxes, 2):
        assert not box_a.overlaps(box_b), (a, b)

    draw(runs, tmp_path / "radar", "corrected", behaviour)
    pixels = matplotlib.image.imread(tmp_path / "radar.png")
    for edge in (pixels[:2], pixels[-2:], pixels[:, :2], pixels[:, -2:]):
        assert (edge[..., :3] > 0.99).all()


def test_radar_llm_judge_votes_through_a_served_text_model(tmp_path):
    """Radar's redundancy judge (judge.mode=llm) as the config builds it: a text model over a pool
    of one OpenAI-compatible server, asked judge.rounds times per trajectory with the judge's
    sampling and token cap, the majority cached in conciseness.jsonl. The server is scripted by
    the trajectory text (a control-flow stand-in for the 72B judge)."""
    from etagent.radar.run import conciseness
    from etagent.records import TrajectoryGroup

    app, bodies = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        bodies.append(body)
        prompt = body["messages"][0]["content"]
        # the first round of each trajectory is unreadable; 'twice' is redundant, 'once' is not
        round_ = sum(b["messages"] == body["messages"] for b in bodies)
        reply = "hmm" if round_ == 1 else ("<answer>yes</answer>" if "twice" in prompt else "<answer>no</answer>")
        return {"choices": [{"message": {"content": reply}}]}

    q = Question(id="q", question="Zorvak Telmin's city?", answer=["Quell"], source="toy_search", kind="qa")
    trajectories = [Trajectory(id=f"q/{k}", text=text, prediction="Quell") for k, text in enumerate(["searched once", "searched twice"])]
    groups = [TrajectoryGroup.for_question(q, trajectories)]
    with serve(app) as url:
        cfg = load_settings("radar", "tiny", ["judge.mode=llm", f"judge.engine.openai.urls=[{url}/v1]", "judge.rounds=3"])
        verdicts = conciseness(build(RadarJudge, cfg.judge), groups, tmp_path)
        assert verdicts == {"q/0": False, "q/1": True}
        asked = len(bodies)
        assert conciseness(build(RadarJudge, cfg.judge), groups, tmp_path) == verdicts and len(bodies) == asked  # cached: not asked again
    assert asked == 6
    body = bodies[0]
    assert body["model"] == "Qwen2.5-72B-Instruct" and body["max_tokens"] == 128 and body["stop"] == ["</answer>"]
    assert body["temperature"] == 0.6 and body["top_p"] == 0.95
    rows = [json.loads(line) for line in (tmp_path / "conciseness.jsonl").read_text().splitlines()]
    # which round came first (and was unreadable) is the server's arrival order
    assert {row["id"]: sorted(row["votes"]) for row in rows} == {"q/0": ["NA", "no", "no"], "q/1": ["NA", "yes", "yes"]}


# --- labels: unique, and never a path ------------------------------------------------------------


@given(st.text(st.characters(codec=None, categories=None) | st.sampled_from("/\\.%\x00\udc80"), min_size=1))
@settings(max_examples=400, deadline=None)
def test_every_label_is_one_folder_inside_out_dir_and_decodes_back(label):
    """The class: whatever a label holds (separators, ``..``, ``%``, control characters,
    any unicode, a command line's undecodable bytes), its folder is one path component inside
    out_dir, and decodes back to the label, so two labels never share a folder."""
    from urllib.parse import unquote

    from etagent.radar.run import label_folder

    name = label_folder(label)
    assert name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name
    assert os.path.dirname(os.path.normpath(os.path.join("/out", name))) == "/out"
    assert unquote(name, errors="surrogatepass") == label


def test_labels_are_unique_and_never_form_paths(toy, tmp_path, capsys):
    """A real evaluation drawn twice: labels holding ``../`` and ``/`` keep every file the radar
    writes inside out_dir, one folder per label; two runs under one label (given, or the name both
    were evaluated under) are refused before anything is written, naming the label."""
    from etagent.evaluation.run import main as evaluate
    from etagent.radar.run import label_folder
    from etagent.radar.run import main as radar

    evaluation = tmp_path / "eval"
    questions = toy / "questions" / "test.jsonl"
    evaluate(
        [
            f"model={toy / 'model'}",
            f"files.toy={questions}",
            f"out_dir={evaluation}",
            "limit=2",
            "n=1",
            "agent.max_response_tokens=16",
            "tools.search.local.url=http://127.0.0.1:9",
            "tools.search.attempts=1",
            "tools.max_failure_share=1",
            "bootstrap_rounds=10",
        ]
    )
    before = {p for p in tmp_path.rglob("*")}
    out = tmp_path / "charts" / "radar"
    labels = ["../escape", "a/b", "..", "a%2Fb"]
    common = [f"tokenizer={toy / 'model'}", "judge.mode=toy_oracle"]
    radar([f"runs=[{','.join([str(evaluation)] * 4)}]", f"labels=[{','.join(repr(x) for x in labels)}]", f"out_dir={out}", *common])
    written = {p for p in tmp_path.rglob("*")} - before
    assert written and all(p == out or out in p.parents for p in written if p != out.parent)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(label_folder(x) for x in labels)
    assert list(json.loads((out / "radar.json").read_text())) == labels
    capsys.readouterr()

    for argv, message in (
        ([f"runs=[{evaluation},{evaluation}]", "labels=[a,a]"], "setting labels[1]: the label 'a' is the label of labels[0]"),
        ([f"runs=[{evaluation},{evaluation}]", "labels=[SFT,sft]"], "setting labels[1]: the label 'sft' differs only in case from 'SFT'"),
        (
            [f"runs=[{evaluation},{evaluation}]"],
            "setting runs[1]: the label 'eval' is the label of runs[0] (the name each was evaluated under",
        ),
        ([f"runs=[{evaluation}]", "datasets=[../eval]"], "setting datasets[0]: '../eval' is not the name of a dataset's folder"),
        ([f"runs=[{evaluation},{evaluation}]", "labels=['',b]"], "setting labels[0]: is an empty label"),
        ([f"runs=[{evaluation}]", f"labels=[{'x' * 300}]"], "setting labels[0]: the label 'xxxx"),
    ):
        refused = tmp_path / "refused"
        with pytest.raises(SystemExit) as exit_status:
            radar([*argv, f"out_dir={refused}", *common])
        err = capsys.readouterr().err.strip()
        assert exit_status.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
        assert not refused.exists()


def test_the_oracle_counts_each_questions_own_needed_calls():
    """The toy oracle reads what each question needs from the question (a hard-world chain
    through two non-landmarks needs two searches and Python; the toy's `both` a search and Python),
    not from a table of the toy's kinds."""
    from etagent.radar.metrics import toy_redundant
    from etagent.records import ToolCallRecord

    def calls(*tools):
        return [ToolCallRecord(tool=t, input="x", output="y", ok=True, seconds=0.0) for t in tools]

    chain = {"search": 2, "python": 1}
    assert not toy_redundant(chain, calls("search", "search", "python"))
    assert toy_redundant(chain, calls("search", "search", "search", "python"))
    assert not toy_redundant({"search": 0, "python": 0}, calls())
    assert toy_redundant({"search": 0, "python": 0}, calls("search"))
