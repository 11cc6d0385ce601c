"""Evaluation on benchmarks: rollouts, metrics, the paper's table (entry: etagent.evaluation.run)."""

from etagent import one_name
from etagent.config import register_stage_schema
from etagent.evaluation.config import EvaluationConfig

one_name(__name__)

# configs/evaluation/ is typed by EvaluationConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("evaluation", EvaluationConfig)
