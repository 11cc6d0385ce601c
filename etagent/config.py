"""Loading a stage's Hydra config: ``configs/<stage>/<preset>.yaml`` plus command-line overrides.

Every stage has one config per preset in ``configs/<stage>/``: ``tiny.yaml`` (the CPU default on
the toy world, every field documented) and, where the stage has one, ``paper.yaml`` (the paper's
numbers on GPUs, written as overrides of ``tiny``). Shared groups (``configs/tools``, ...) are
pulled in through Hydra defaults lists. Overrides use Hydra's grammar: ``key=value``,
``+new_key=value``, ``~key``.

This uses Hydra's compose API, so stages run as plain functions (no working-directory change,
no ``outputs/`` folders); each stage saves its resolved config in its ``manifest.json``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig


def config_dir() -> Path:
    """The ``configs/`` folder: ``$ETAGENT_CONFIG_DIR`` or the one beside the installed sources."""
    path = Path(os.environ.get("ETAGENT_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))
    if not path.is_dir():
        raise FileNotFoundError(
            f"no configs directory at {path}: install the toolkit from its repository (pip install -e .) or set ETAGENT_CONFIG_DIR"
        )
    return path


def presets(stage: str) -> list[str]:
    """The presets available for a stage."""
    return sorted(p.stem for p in (config_dir() / stage).glob("*.yaml"))


def load_config(stage: str, preset: str = "tiny", overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``configs/<stage>/<preset>.yaml`` with overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    root = config_dir()
    if not (root / stage / f"{preset}.yaml").exists():
        raise FileNotFoundError(f"no preset {preset!r} for stage {stage!r} in {root / stage} (have: {', '.join(presets(stage)) or 'none'})")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(root), version_base=None):
        return compose(config_name=f"{stage}/{preset}", overrides=list(overrides))


def parse_stage_args(stage: str, argv: Sequence[str] | None, prog: str, doc: str | None = None) -> DictConfig:
    """The command line of a stage entry point: ``[--preset NAME] [key=value ...]``."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help=f"configs/{stage}/PRESET.yaml (default: tiny)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. key=value")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return load_config(stage, args.preset, args.overrides)
