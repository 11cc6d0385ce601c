"""Radar metrics (conciseness, successful execution, reasoning length) and the chart (entry: etagent.radar.run)."""

from etagent.config import register_stage_schema
from etagent.radar.config import RadarConfig

# configs/radar/ is typed by RadarConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("radar", RadarConfig)
