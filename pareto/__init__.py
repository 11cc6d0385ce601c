"""Group-wise Pareto selection of a curriculum stage's RL questions (entry: etagent.pareto.run)."""

from etagent import one_name
from etagent.config import register_stage_schema
from etagent.pareto.config import ParetoConfig

one_name(__name__)

# configs/pareto/ is typed by ParetoConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("pareto", ParetoConfig)
