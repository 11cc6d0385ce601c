"""The OpenAI-compatible gateway: an outside agent harness drives the policy on the chat API,
and every token the engine sees is kept (docs/gateway.md).

formats.py renders chats into ids and reads tool calls back; sessions.py keeps each session's
turns and training segments; server.py is the HTTP face; harness.py runs a harness over it and
turns sessions into the agent loop's trajectories for RL and the sampling stages."""
