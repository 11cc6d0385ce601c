"""The shared groups' objects for tests that run without a stage's config: each from its
``configs/<group>/_base.yaml`` (:func:`etagent.config.base_group`), with what a test changes, so
no test restates a documented value."""

from __future__ import annotations

from etagent.agent import AgentConfig
from etagent.config import base_group
from etagent.flywheel.evolve import FlywheelSettings
from etagent.llm import VLLMConfig
from etagent.tools.sandbox import SandboxLimits

# what configs/agent/_base.yaml leaves to each preset (???), as the agent loop's tests were written
# against: generous budgets, a wall-clock limit, unseeded, no top-p and no penalty
AGENT_OPEN_VALUES = {
    "max_response_tokens": 4096,
    "max_segment_tokens": 4096,
    "timeout_s": 1200.0,
    "seed": None,
    "sampling": {"top_p": 1.0, "repetition_penalty": 1.0},
}


def agent_config(**changes) -> AgentConfig:
    return base_group(AgentConfig, "agent", **{**AGENT_OPEN_VALUES, **changes})


def sandbox_limits(**changes) -> SandboxLimits:
    return base_group(SandboxLimits, "tools", "python.limits", **changes)


def vllm_config(**changes) -> VLLMConfig:
    return base_group(VLLMConfig, "engine", "vllm", **changes)


def flywheel_settings(**changes) -> FlywheelSettings:
    """configs/flywheel/_base.yaml's ``flywheel`` group, one question at a time with a generous
    limit (what the presets leave open)."""
    return base_group(FlywheelSettings, "flywheel", "flywheel", **{"concurrency": 1, "question_timeout_s": 600.0, **changes})
