"""The `etagent` command as users run it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def etagent(*args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "etagent.launcher", *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_help_lists_the_commands():
    out = etagent("--help")
    assert out.returncode == 0 and "toy" in out.stdout and "score" in out.stdout
    assert etagent("no-such-command").returncode == 2


def test_score_writes_every_metric_per_line():
    lines = [
        {"prediction": "0.50", "answers": ["\\frac{1}{2}"], "kind": "math"},
        {"prediction": "The Beatles", "answers": "beatles", "kind": "qa", "id": "x"},
    ]
    out = etagent("score", stdin="".join(json.dumps(line) + "\n" for line in lines))
    assert out.returncode == 0, out.stderr
    first, second = (json.loads(line) for line in out.stdout.splitlines())
    assert first["math_equal"] == 1.0 and first["is_equiv"] == 0.0 and first["correctness"] == 1.0
    assert second["em"] == 1.0 and second["f1_paper"] == 1.0 and second["id"] == "x"
    for key in ("em", "f1", "acc", "em_paper", "f1_paper", "acc_paper", "f1_raw_whitespace", "is_equiv", "math_verify", "math_equal"):
        assert key in first and key in second


@pytest.mark.parametrize(
    "line, message",
    [
        ({"answers": ["1"]}, "<stdin>:2: field 'prediction': missing"),
        ({"prediction": "1"}, "<stdin>:2: field 'answers': missing"),
        ({"prediction": "1", "answers": "1", "kind": "maths"}, "<stdin>:2: field 'kind'"),
    ],
)
def test_score_bad_input_names_line_and_field_and_keeps_earlier_output(line, message):
    good = {"prediction": "1", "answers": ["1"], "kind": "math"}
    out = etagent("score", stdin=json.dumps(good) + "\n" + json.dumps(line) + "\n")
    assert out.returncode != 0
    assert message in out.stderr
    assert json.loads(out.stdout.splitlines()[0])["math_equal"] == 1.0  # the first line was written
