"""ET-Agent toolkit: the shared core every stage uses.

Modules: ``protocol`` (the tool-integrated reasoning text protocol), ``records`` (artifacts and
their readers/writers), ``scoring`` (answer metrics and the LLM judge), ``agent`` (the agent
loop), ``sampling`` (n rollouts per question, here or over Ray), ``llm`` (the engines: hf, vLLM,
OpenAI-compatible; ``Sampling``, the one sampling type; ``llm.text``, the text models: judges,
editor, summariser), ``tools`` (Python sandbox, search, the
executor), ``config`` (loading and checking the Hydra presets, the shared groups' typed schemas,
``build``), ``rundir`` (claiming an output directory, resuming, manifests), ``errors`` (user
errors that name the file, line and field), ``net`` (HTTP calls with timeouts and retries),
``timing`` (named phases), ``toy`` (the embedded toy world and tiny model), ``cli`` (the core's
``etagent score`` and ``etagent tool``). The core imports no stage; the ``etagent`` command that
reaches them is ``launcher/``.
"""

import os

__version__ = "0.1.0"

# MKL's strict conditional numerical reproducibility: its matrix products sum in the same order at
# any thread count. Without it the CPU flash attention's small per-block products while decoding
# (queries of 1 to 3 tokens) sum differently at 1 and 2 threads, so the engine's log-probabilities
# moved by up to 3e-6 whenever etagent/threads.py gave a run fewer threads beside a busy process,
# and the RL rows with them (docs/reproducibility.md). MKL reads it once, at its first call; every
# stage imports this package before torch. The toy's SFT ran about 2% slower with it (docs/engines.md).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def one_name(module: str) -> None:
    """Refuse a stage's package imported by its folder's name. Each stage folder (``rl/``) is the
    module ``etagent.rl`` through the link ``etagent/rl``; from the repository's root Python could
    also import the folder as ``rl``, a second copy of every module whose classes are not the
    first's. Each stage's ``__init__`` calls this, so that mistake fails at once, naming the fix."""
    if not module.startswith("etagent."):
        raise ImportError(f"the stage package {module!r} is etagent.{module}: import it, or run it with python -m, under that name")
