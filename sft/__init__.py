"""SFT: fine-tune the policy on trajectories with tool results masked (entry: etagent.sft.run)."""

from etagent import one_name
from etagent.config import register_stage_schema
from etagent.sft.config import SFTConfig

one_name(__name__)

# configs/sft/ is typed by SFTConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("sft", SFTConfig)
