"""The self-evolving data flywheel and its export as SFT data (entries: etagent.flywheel.run, etagent.flywheel.export)."""

from etagent import one_name
from etagent.config import register_stage_schema
from etagent.flywheel.config import FlywheelConfig

one_name(__name__)

# configs/flywheel/ is typed by FlywheelConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("flywheel", FlywheelConfig)
