"""Direct rollout: K chains per question with the current policy, judged for Pareto selection.

    python -m etagent.direct_rollout.run [--preset tiny|paper] [overrides]    # or: etagent direct-rollout ...
    bash scripts/prepare_rl_stage.sh MODEL STAGE                      # with Pareto, for RL stage k

Before RL stage k the paper samples 8 chains per question with policy k-1 (the SFT model for
stage 1) and keeps the questions whose chains disagree (``pareto/``). This stage does the
sampling, through the shared machinery of :mod:`etagent.sampling` (any engine, Ray fan-out,
resumable after ``kill -9``, progress with rates), with the paper's sampling and budgets
(``configs/direct_rollout``). It writes ``out_dir/trajectories.jsonl``, one line per question,
whose chains each carry the text, prediction, correctness (the judgement), tool calls executed
(``tool_calls_executed``, the paper's count) and as the protocol counts them
(``tool_calls_written``), generated length (``n_generated``) and finish reason; and
``manifest.json`` with the summary, overall and per kind.

Correctness is what the paper's Pareto step reads but its code never computes
(docs/paper-code.md §A4.1): math, 0 or 1 by math equivalence (the MATH string rules or
math-verify) against any gold answer; QA, the best token F1 over the gold answers (SQuAD
normalisation), whose verdict is F1 >= ``qa_pass_mark`` (0.75 in the presets, Pareto's bar).

What this stage does not do: select questions (``pareto/``), or keep per-token arrays (token
ids, masks, log-probabilities): nothing downstream reads them, RL samples its own rollouts, and
at the paper's scale (20,000 questions x 8 chains x up to 16k tokens) they would make the file
tens of gigabytes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

from etagent import scoring
from etagent.direct_rollout.config import DirectRolloutConfig
from etagent.errors import DegradedRun, exit_on_user_error
from etagent.records import Judgement
from etagent.sampling import degraded_reasons, describe_context_overflow, describe_engine_failures, plan_sampling, run_sampling
from etagent.tools.executor import describe_failures

log = logging.getLogger("direct_rollout")


def chain_judgement(prediction: str, golds: Sequence[str], kind: str, qa_pass_mark: float) -> Judgement:
    """A chain's correctness: math 0/1 by equivalence with any gold answer, QA the best F1
    (correct from ``qa_pass_mark`` on)."""
    if kind == "math":
        score = float(scoring.math_equal(prediction, golds))
        return Judgement(metric="math_equal", score=score, verdict=score == 1.0)
    score = scoring.best_over_golds(scoring.f1, prediction, golds)
    return Judgement(metric="f1", score=score, verdict=score >= qa_pass_mark, threshold=qa_pass_mark)


def plan(cfg: DirectRolloutConfig) -> None:
    """Everything the stage can refuse, before it claims its output folder: the sampling's settings,
    inputs and questions under this stage's schema, so that a refused policy is named as the user
    set it (``model``) (etagent.sampling.plan_sampling, which :func:`run` runs inside run_sampling)."""
    plan_sampling(cfg, DirectRolloutConfig)


def run(cfg: DirectRolloutConfig) -> dict:
    """Roll out every question not yet in cfg.out_dir; return the summary metrics."""
    stage = f"direct_rollout/stage{cfg.rl_stage}"
    return run_sampling(
        cfg, stage, judge=partial(chain_judgement, qa_pass_mark=cfg.qa_pass_mark), token_arrays=False, schema=DirectRolloutConfig
    )


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    from etagent.stage_cli import stage_configs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per tool request is noise
    for cfg in stage_configs("direct_rollout", argv, prog="python -m etagent.direct_rollout.run", doc=__doc__, plan=plan):
        m = run(cfg)
        kinds = ", ".join(f"{kind} {s['mean_score']:.3f}" for kind, s in m["per_kind"].items())
        print(
            f"direct rollout for RL stage {cfg.rl_stage}: {m['trajectories']} chains of {m['questions']} questions in {cfg.out_dir}\n"
            f"  correctness {m['mean_score']:.3f} ({kinds}); tool calls {m['mean_tool_calls_executed']:.2f} executed, "
            f"{m['mean_tool_calls_written']:.2f} written; {m['mean_generated_tokens']:.0f} generated tokens; finish {m['finish_reasons']}\n"
            f"  tool failures: {describe_failures(m['tool_failures'])}\n"
            f"  {describe_context_overflow(m['context_overflow'])}; {describe_engine_failures(m['engine_failures'])}"
        )
        if m["degraded"]:
            raise DegradedRun(
                f"{'; '.join(degraded_reasons(m, cfg.tools.max_failure_share))}, over tools.max_failure_share={cfg.tools.max_failure_share}: "
                f"the records in {cfg.out_dir} are written but not to be trusted; rerun into a new out_dir once fixed"
            )


if __name__ == "__main__":
    main()
