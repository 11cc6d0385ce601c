"""Group-wise Pareto selection of a curriculum stage's RL questions (entry: etagent.pareto.run)."""

from etagent.config import register_stage_schema
from etagent.pareto.config import ParetoConfig

# configs/pareto/ is typed by ParetoConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("pareto", ParetoConfig)
