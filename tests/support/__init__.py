"""What the tests share that is not a fixture: the command lines they run as users type them
(commands.py), servers on 127.0.0.1 (servers.py), headless Chromium (browser.py), the stand-in
for vLLM's ``LLM`` (vllm_standin.py), mask helpers (trajectories.py), and the scripts tests run
as subprocesses (weight_sync_ranks.py, weight_updates.py, rl_killed_in_save.py). Fixtures are in
tests/conftest.py; no test module imports another."""
