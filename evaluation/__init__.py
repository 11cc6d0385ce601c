"""Evaluation on benchmarks: rollouts, metrics, the paper's table (entry: etagent.evaluation.run)."""

from etagent.evaluation.config import EvaluationConfig

from etagent.config import register_stage_schema

# configs/evaluation/ is typed by EvaluationConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("evaluation", EvaluationConfig)
