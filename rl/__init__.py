"""RL: GRPO with ARPO's tree rollout and the efficiency reward on a curriculum stage (entry: rl.run)."""

from etagent.config import register_stage_schema
from rl.config import RLConfig

# configs/rl/ is typed by RLConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("rl", RLConfig)
