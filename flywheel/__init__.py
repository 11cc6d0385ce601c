"""The self-evolving data flywheel and its export as SFT data (entries: etagent.flywheel.run, etagent.flywheel.export)."""

from etagent.flywheel.config import FlywheelConfig

from etagent.config import register_stage_schema

# configs/flywheel/ is typed by FlywheelConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("flywheel", FlywheelConfig)
