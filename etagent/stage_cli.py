"""The command line every stage shares, with the flags Hydra users know:

    python -m etagent.rl.run [--preset NAME] [--restart] [key=value ...]   run (resuming where it stopped)
    python -m etagent.rl.run --cfg job [key=value ...]                     print the config, resolved, and exit
    python -m etagent.rl.run --info [key=value ...]                        where the config comes from, what it reads and writes
    python -m etagent.rl.run -m seed=0,1 lr=1e-3,1e-4                      a sweep: one run per combination
    python -m etagent.rl.run --help                                        these flags, and every setting with its doc

Overrides are Hydra's (``key=value``, ``+new_key=value``, ``~key``); with ``-m`` a value may be a
sweep (``a,b``, ``range(0,3)``, ``choice(a,b)``) and every combination runs in turn, as Hydra's
basic sweeper orders them, each in its own output folder: every output folder the stage's schema
declares gets a subfolder named after the swept values (``out_dir/seed=0``), as Hydra's multirun
gives each job its own directory. Distinct runs never share a folder: the characters that would
make two names one (a path separator, ``%``, and the ``,`` and ``=`` that join the pairs) are
percent-encoded (``model=a/b`` is ``model=a%2Fb``, and ``model=a_b`` stays itself), and a sweep
whose names would still meet (cut to the file system's limit, or equal but for case) is refused,
naming both runs. A key whose value in the preset is an interpolation of another
(``engine.model: ${model}``) is refused as an override, naming the key that sets it: one name per
value across the stages.

What this module does not do: compose configs (etagent/config.py) or run a stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from etagent.config import SCHEMAS, config_dir, load_config, load_settings
from etagent.errors import UserError
from etagent.settings import PathKind, output_folders, settings_of, wanted


def stage_configs(
    stage: str,
    argv: Sequence[str] | None,
    prog: str,
    doc: str | None = None,
    resumes: bool = True,
    plan: Callable[[Any], Any] | None = None,
) -> list:
    """The typed configs to run from a stage's command line (the stage's schema, built once here
    and passed down as it is): one, or one per sweep combination with ``-m``. ``--cfg job`` and ``--info`` print and exit. ``--restart`` starts the stage over in
    its output folder: what the folder holds is moved into a sibling folder first
    (etagent.rundir.set_aside), instead of being resumed, once every run's ``plan`` (the stage's
    checks before it claims its folder) has passed: a run that would be refused moves nothing.
    A command that does not resume
    (``resumes=False``: the retriever's server, which writes nothing, and the flywheel's export,
    which rewrites its files and reads the flywheel's folder) has no ``--restart`` and no ``-m``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(arg in ("-h", "--help") for arg in argv)
    parser = argparse.ArgumentParser(
        prog=prog,
        description=doc,
        epilog=settings_help(stage) if wants_help else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="tiny", help=f"configs/{stage}/PRESET.yaml (default: tiny)")
    if resumes:
        parser.add_argument(
            "--restart",
            action="store_true",
            help="start over instead of resuming: the output folder's contents are moved to OUT.previous-TIME (nothing is deleted)",
        )
    parser.set_defaults(restart=False)
    parser.add_argument("--cfg", choices=("job",), help="print the config, every interpolation resolved, and exit (Hydra's --cfg job)")
    parser.add_argument("--info", action="store_true", help="print where the config comes from and what the run reads and writes, and exit")
    if resumes:  # a sweep writes one output folder per run; the commands that do not resume write none of their own
        parser.add_argument("-m", "--multirun", action="store_true", help="a sweep: a,b or range(a,b) values, one run per combination")
    parser.set_defaults(multirun=False)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. key=value (see the settings below --help)")
    args = parser.parse_args(argv)

    jobs = sweep(args.overrides) if args.multirun else [(args.overrides, None)]
    configs = []
    for overrides, subfolder in jobs:
        refuse_interpolated_overrides(stage, args.preset, overrides)
        cfg = load_settings(stage, args.preset, overrides)
        if subfolder is not None:
            in_subfolders(stage, cfg, subfolder)
        configs.append(cfg)
    if args.cfg:
        for cfg in configs:
            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
        sys.exit(0)
    if args.info:
        print(info(stage, args.preset, args.overrides, configs[0]))
        sys.exit(0)
    if args.restart and int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 owns the folder
        from etagent.rundir import set_aside

        if plan is None:
            raise TypeError(f"{prog}: a command with --restart passes its stage's plan to stage_configs")
        for cfg in configs:  # every run's checks before anything moves
            plan(cfg)
        for cfg in configs:
            for aside in set_aside(SCHEMAS[stage][0], dataclasses.asdict(cfg)):
                logging.getLogger(stage).warning("--restart: the earlier outputs are in %s", aside)
    if len(configs) > 1:
        logging.getLogger(stage).info("sweep: %d runs (%s)", len(configs), ", ".join(name for _, name in jobs))
    return configs


# ---------------------------------------------------------------------------------------------
# -m


def sweep(overrides: Sequence[str]) -> list[tuple[list[str], str]]:
    """Every combination of the sweep overrides (the last key varying fastest, as Hydra's basic
    sweeper runs them), each with its subfolder name: the swept ``key=value`` pairs joined by
    commas, as Hydra's ``override_dirname``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise UserError(f"overrides {' '.join(overrides)}: {str(exc).splitlines()[0]}") from None
    axes = []
    for override in parsed:
        if override.is_sweep_override():
            axes.append([(f"{override.get_key_element()}={value}", True) for value in override.sweep_string_iterator()])
        else:
            axes.append([(override.input_line, False)])
    if not any(swept for axis in axes for _, swept in axis):
        raise UserError("-m: no override sweeps anything; give a key several values, e.g. seed=0,1")
    jobs = []
    folders: dict[str, str] = {}
    for combination in itertools.product(*axes):
        line = [text for text, _ in combination]
        swept = [text.lstrip("+~").partition("=")[::2] for text, is_swept in combination if is_swept]
        shown = " ".join(f"{key}={value}" for key, value in swept)
        name = run_folder(swept)
        other = folders.setdefault(name.casefold(), shown)
        if other != shown:
            raise UserError(
                f"-m: the runs {other!r} and {shown!r} would share the output folder {name} (names cut to the file system's "
                "limit, or equal but for case): sweep values that differ more"
            )
        jobs.append((line, name))
    return jobs


# Characters percent-encoded in a sweep folder's name: the path separators, "%" itself, the "="
# and "," that join the pairs, and control characters. What is left decodes back to the pairs.
FOLDER_ESCAPED = re.compile(r"[%/\\,=\x00-\x1f\x7f]")
# The longest file name the usual file systems allow, in bytes.
MAX_NAME_BYTES = 255


def run_folder(pairs: Sequence[tuple[str, str]]) -> str:
    """A sweep run's subfolder: its swept ``key=value`` pairs joined by commas, as Hydra's
    ``override_dirname``, each key and value percent-encoded where it holds a character of
    :data:`FOLDER_ESCAPED`, so that distinct runs get distinct names. A name past the file
    system's 255 bytes is cut and ends with a hash of the whole."""

    def escape(text: str) -> str:
        return FOLDER_ESCAPED.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), text)

    name = ",".join(f"{escape(key)}={escape(value)}" for key, value in pairs)
    # as bytes, a command line's undecodable bytes (lone surrogates) included
    encoded = name.encode(errors="surrogatepass")
    if len(encoded) <= MAX_NAME_BYTES:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    return f"{encoded[: MAX_NAME_BYTES - len(digest) - 1].decode(errors='ignore')}~{digest}"


def in_subfolders(stage: str, cfg, subfolder: str) -> None:
    """Move every output folder ``cfg``'s schema declares into ``subfolder`` of itself."""
    for key, path in output_folders(SCHEMAS[stage][0], dataclasses.asdict(cfg)):
        *groups, leaf = key.split(".")
        setattr(functools.reduce(getattr, groups, cfg), leaf, str(Path(path) / subfolder))


# ---------------------------------------------------------------------------------------------
# One name per value


def refuse_interpolated_overrides(stage: str, preset: str, overrides: Sequence[str]) -> None:
    """An override of a key whose value in the preset is another key's (``engine.model:
    ${model}``) is refused, naming the key to set instead: it would part two names that the
    stage keeps as one."""
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
    if not keys:
        return
    aliases = preset_aliases(stage, preset)
    for key in keys:
        if key in aliases:
            raise UserError(
                f"setting {key}: is {aliases[key]}'s value in every preset of {stage} (one name per value): set {aliases[key]}=... instead"
            )


def preset_aliases(stage: str, preset: str) -> dict[str, str]:
    """Every key of the preset whose whole value is another key's (``engine.model: ${model}``; a
    template such as ``stage${rl_stage}`` is not), with that key. Composing the preset takes a
    quarter of a second, so it is done once per process for as long as no config file changes
    (a sweep, and every stage called in one process, ask again)."""
    root = config_dir()
    files = tuple(sorted((str(path), path.stat().st_mtime_ns) for path in root.rglob("*.yaml")))
    return _aliases_in(stage, preset, files)


@functools.lru_cache(maxsize=64)
def _aliases_in(stage: str, preset: str, files: tuple) -> dict[str, str]:
    from etagent.config import interpolated_keys

    plain = load_config(stage, preset)
    aliases = {}
    for key in interpolated_keys(plain):
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(plain, parent_key) if parent_key else plain
        alias = ALIAS.fullmatch(str(OmegaConf.to_container(parent, resolve=False)[leaf]))
        if alias:
            aliases[key] = alias.group(1)
    return aliases


# ---------------------------------------------------------------------------------------------
# --info and --help


def info(stage: str, preset: str, overrides: Sequence[str], cfg) -> str:
    from etagent.settings import input_paths

    preset_file = config_dir() / stage / f"{preset}.yaml"
    preset_yaml = OmegaConf.load(preset_file)
    defaults = [
        ", ".join(f"{k}: {v}" for k, v in d.items()) if isinstance(d, DictConfig) else str(d) for d in preset_yaml.get("defaults", [])
    ]
    values = dataclasses.asdict(cfg)
    schema = SCHEMAS[stage][0]
    lines = [
        f"stage: {stage} (schema {schema.__module__}.{schema.__name__})",
        f"config directory: {config_dir()}",
        f"preset: {preset_file}",
        f"defaults list: {', '.join(defaults) or '(none)'}",
        f"overrides: {' '.join(overrides) or '(none)'}",
        f"resolved preset: {config_dir() / 'resolved' / stage / f'{preset}.yaml'}",
        "reads:",
        *[f"  {key} = {value} ({kind})" for key, value, kind in input_paths(schema, values)],
        "writes:",
        *[f"  {key} = {value}" for key, value in output_folders(schema, values)],
    ]
    return "\n".join(lines)


ALIAS = re.compile(r"\$\{([\w.]+)\}")
KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][\w-]*):")


def yaml_docs(path: Path) -> dict[str, str]:
    """Each key of a documented YAML file with the comment just above it, as one line."""
    docs: dict[str, str] = {}
    if not path.is_file():
        return docs
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    previous: tuple[int, str] | None = None  # the last key line's indent and doc, while keys follow on
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        match = KEY_LINE.match(line)
        if not match:
            if not stripped:
                comment, previous = [], None
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        text = " ".join(part for part in comment if part and not part.startswith("@package"))
        if not text and previous is not None and previous[0] == indent:
            text = previous[1]  # one comment above a run of keys documents them all ("out_dir ... and run_name")
        previous = (indent, text)
        alias = ALIAS.fullmatch(line[match.end() :].split(" #")[0].strip())
        if alias:  # another key's value: that key is the one to set
            text = f"follows {alias.group(1)} (set that)"
        if text:
            docs[".".join(k for _, k in stack)] = text
        comment = []
    return docs


def first_sentence(text: str, limit: int = 110) -> str:
    """The first sentence of a doc (two when the first is a heading such as "AdamW."), cut at
    ``limit`` characters."""
    sentences = re.split(r"(?<=[.;])\s", text)
    sentence = " ".join(sentences[:2]) if len(sentences[0]) < 30 else sentences[0]
    return sentence if len(sentence) <= limit else sentence[: limit - 3].rstrip() + "..."


def documented_file(stage: str) -> Path:
    """Where a stage's settings are documented: its ``_base.yaml``, or its one preset where it has
    no base (the toy world)."""
    base = config_dir() / stage / "_base.yaml"
    return base if base.is_file() else config_dir() / stage / "tiny.yaml"


def settings_help(stage: str) -> str:
    """Every setting of a stage: its key, what it must be (from its declaration) and the first
    sentence of its doc in ``configs/<stage>/_base.yaml`` (a shared group's keys: its own file)."""
    root = config_dir()
    own = yaml_docs(documented_file(stage))
    groups = {p.name: yaml_docs(p / "_base.yaml") for p in root.iterdir() if p.is_dir() and p.name not in ("resolved", stage)}
    lines = [f"settings (each documented in {documented_file(stage).relative_to(root.parent)} or its group's; override with key=value):"]
    for setting in settings_of(SCHEMAS[stage][0]):
        parts = setting.key.split(".")
        doc = own.get(setting.key)
        for i in range(len(parts) - 1, -1, -1):  # a shared group's own file documents its keys
            if doc is None and parts[i] in groups:
                doc = groups[parts[i]].get(".".join(parts[i + 1 :]))
        kind = wanted(setting).removeprefix("must be ")
        path = setting.first(PathKind)
        if path is not None:  # what the path names, not its Python type
            kind = f"{path.role} {path.kind}" + (" or null" if setting.optional else "")
        if setting.container is not None:
            kind = f"{setting.container.__name__} of {kind}"
        lines.append(f"  {setting.key:<40} {kind}" + (f"  {first_sentence(doc)}" if doc else ""))
    return "\n".join(lines)
