"""The radar metrics (radar/): the paper's rules for a tool result and redundancy votes, the chart's
layout, and the redundancy judge through a served text model."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request

from etagent.config import build, load_config
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
        cfg = load_config("radar", "tiny", ["judge.mode=llm", f"judge.engine.openai.urls=[{url}/v1]", "judge.rounds=3"])
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
