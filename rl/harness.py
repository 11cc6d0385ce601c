"""Rollouts an outside agent harness drives through the gateway (``rollout.kind: gateway``).

Each step, the gateway serves the trainer's own engine on 127.0.0.1, ``n`` sessions are opened
per prompt (the prompt's group), and the harness command (``rollout.gateway.harness``) runs once
over all of them (etagent/gateway/harness.py). The sessions become the step's groups, scored by
the same reward (the efficiency reward counts the tool calls the harness ran) and trained as our
own rollouts are: GRPO advantages, the recorded log-probabilities, packing, TIS. The gateway
samples with ``agent.sampling`` whatever the harness asks: the policy gradient is of the
distribution the trainer assumes.

A session the harness did not end, or one that forked, is a failed rollout (finish reason
``error``, its cause named): never trained on, left out of its group's baseline.

What this does not do: ARPO's tree or partial rollouts (both need our own loop to decide where a
path forks or stops; rl/run.py refuses them with this kind), or run the tools.
"""

from __future__ import annotations

from etagent.agent import AgentLoop
from etagent.gateway.harness import GatewaySettings, HarnessRunner, session_trajectory
from etagent.rl.rollout import Prompt, StepRollouts


class GatewayRollout:
    """``n`` harness-driven sessions per prompt (module docstring)."""

    def __init__(self, n: int, settings: GatewaySettings):
        self.n, self.settings = n, settings
        self.runner: HarnessRunner | None = None

    def generate(self, loop: AgentLoop, prompts: list[Prompt], step: int, seed: int) -> StepRollouts:
        if self.runner is None:
            self.runner = HarnessRunner(loop.engine, self.settings, loop.config.max_segment_tokens, loop.config.sampling)
        tasks = [
            (p.question.question, str(p.index), {"id": p.question.id}, seed * 1_000_003 + step * 1009 + i * 31 + k)
            for i, p in enumerate(prompts)
            for k in range(self.n)
        ]
        sessions, failure = self.runner.run(tasks, loop.config.max_response_tokens, version=loop.version)
        groups = []
        for i, p in enumerate(prompts):
            group = []
            for k in range(self.n):
                state = session_trajectory(loop, sessions[i * self.n + k], p.question, f"s{step}-p{p.index}-{k}", failure)
                state.policy_version = f"step{step - 1}"
                group.append(state)
            groups.append(group)
        turns = [t for s in sessions for t in s.turns]
        counts = {
            "tool_calls_executed": float(sum(t.executed() for group in groups for t in group)),
            "gateway_turns": float(len(turns)),
            "gateway_later_turns": float(sum(t.kind != "start" for t in turns)),
            "gateway_forks": float(sum(t.kind == "fork" for t in turns)),
            "gateway_realigns": float(sum(t.kind == "realign" for t in turns)),
            "gateway_sessions": float(len(sessions)),
            "gateway_not_ended": float(sum(s.state != "ended" for s in sessions)),
        }
        return StepRollouts(groups, counts, prompts)
