"""RL: GRPO with ARPO's tree rollout and the efficiency reward on a curriculum stage (entry: etagent.rl.run)."""

from etagent import one_name
from etagent.config import register_stage_schema
from etagent.rl.config import RLConfig

one_name(__name__)

# configs/rl/ is typed by RLConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("rl", RLConfig)
