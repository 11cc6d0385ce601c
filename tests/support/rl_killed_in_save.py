"""etagent.rl.run, killed with SIGKILL in the middle of saving a checkpoint: after every rank has written
its shards and state.json into ``checkpoints/step_{k}.tmp``, before the folder is renamed (what a
kill during a save leaves). Run by tests/test_rl.py as ``python -m tests.support.rl_killed_in_save STEP
[overrides]``; a test double of the crash only, the trainer is the real one."""

from __future__ import annotations

import os
import signal
import sys

import etagent.rl.checkpoint
import etagent.rl.run

real_commit = etagent.rl.checkpoint.commit


def commit_or_die(tmp, folder, step=int(sys.argv[1])):
    if folder.name == f"step_{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    real_commit(tmp, folder)


etagent.rl.checkpoint.commit = commit_or_die
etagent.rl.run.main(sys.argv[2:])
