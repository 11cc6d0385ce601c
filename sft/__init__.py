"""SFT: fine-tune the policy on trajectories with tool results masked (entry: sft.run)."""

from etagent.config import register_stage_schema
from sft.config import SFTConfig

# configs/sft/ is typed by SFTConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("sft", SFTConfig)
