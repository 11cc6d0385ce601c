"""Direct rollout: K chains per RL-pool question with the stage's starting policy (entry: etagent.direct_rollout.run)."""

from etagent import one_name
from etagent.config import register_stage_schema
from etagent.direct_rollout.config import DirectRolloutConfig

one_name(__name__)

# configs/direct_rollout/ is typed by DirectRolloutConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("direct_rollout", DirectRolloutConfig)
