"""Radar metrics (conciseness, successful execution, reasoning length) and the chart (entry: etagent.radar.run)."""

from etagent import one_name
from etagent.config import register_stage_schema
from etagent.radar.config import RadarConfig

one_name(__name__)

# configs/radar/ is typed by RadarConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("radar", RadarConfig)
