"""The self-evolving data flywheel and its export as SFT data (entries: flywheel.run, flywheel.export)."""

from etagent.config import register_stage_schema
from flywheel.config import FlywheelConfig

# configs/flywheel/ is typed by FlywheelConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("flywheel", FlywheelConfig)
