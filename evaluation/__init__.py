"""Evaluation on benchmarks: rollouts, metrics, the paper's table (entry: etagent.evaluation.run)."""

from etagent.config import register_stage_schema
from etagent.evaluation.config import EvaluationConfig

# configs/evaluation/ is typed by EvaluationConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("evaluation", EvaluationConfig)
