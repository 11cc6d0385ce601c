"""How a setting is declared, and every check that follows from its declaration.

A stage's config is a tree of dataclasses (``<stage>/config.py``; a shared group beside the code
that reads it). Each field is one setting, declared once: its type and, in ``Annotated``
metadata, what else is true of it::

    learning_rate: PositiveFloat = MISSING                     # > 0 and finite
    top_p: Annotated[float, Gt(0), Le(1)] = MISSING            # in (0, 1]
    kind: Annotated[str, OneOf("hf", "vllm")] = MISSING        # one of these
    model: ModelPath = MISSING                                 # an input: a model folder
    threads: Annotated[NonNegativeInt, FREE] = MISSING         # a resumed run may change it

Hydra and OmegaConf see only the plain type (they drop ``Annotated``'s metadata), and check keys
and types at load. From the metadata come:

- :func:`validate`: every value within its constraints, by pydantic over the composed config, at
  load (``etagent.config.load_config``). Numbers are finite everywhere (NaN passes every ``<``
  and ``>``) unless a field says :data:`NON_FINITE_OK`.
- :func:`input_paths` and :func:`check_paths`: the files, folders and models a run reads, each
  checked for its kind before any work, and the output folder kept apart from all of them;
  :func:`check_model_weights`: a model's weights against its config (it imports torch: a plan
  runs it last).
- :func:`free_keys`: the settings a resumed run may change (``FREE``: where and how fast work
  runs, never what it computes); every other setting must equal the manifest's
  (``etagent.rundir``).

A group that has an ``enabled`` field set to false is not read by its stage: its paths are not
checked (an editor or judge that is off may name a model that is not there). Ranges are checked
all the same: a value out of range is wrong whether or not it is read.

It also holds the checks of the machine a stage runs on that settings ask for
(:func:`check_device`, :func:`check_installed`): every stage runs them in its plan, before it
claims its output folder.

What this module does not do: hold any setting's value or documentation (those are in
``configs/<stage>/_base.yaml``), or check relations between settings (each stage's
``check_settings`` does, naming the keys).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from annotated_types import Ge, Gt, Le, Len, Lt
from pydantic import AllowInfNan, ConfigDict, TypeAdapter, ValidationError
from pydantic_core import core_schema

from etagent.errors import EXTRAS, RecordError, SettingError
from etagent.json_text import decode_json, read_json_file

# ---------------------------------------------------------------------------------------------
# The vocabulary of declarations


@dataclass(frozen=True)
class Free:
    """A resumed run may change this setting: it says where or how fast work runs, or how it is
    logged, never what the run computes."""


FREE = Free()

# A number that may be infinite or NaN (no field says so today; the marker is how one would).
NON_FINITE_OK = AllowInfNan(True)


@dataclass(frozen=True)
class OneOf:
    """The value is one of ``choices``."""

    choices: tuple[Any, ...]

    def __init__(self, *choices: Any):
        object.__setattr__(self, "choices", choices)

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, value):
        if value not in self.choices:
            raise ValueError(f"must be one of {', '.join(map(str, self.choices))}")
        return value


@dataclass(frozen=True)
class NotBlank:
    """The value is text that is not empty or only spaces: an output folder named ``''`` would be
    the current folder."""

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, value):
        if not str(value).strip():
            raise ValueError("must be a path, not empty")
        return value


NOT_BLANK = NotBlank()


@dataclass(frozen=True)
class PathKind:
    """The setting names a path the run reads (``input``) or writes (``output``), and what must
    be there: ``file``, ``folder``, ``file or folder``, ``data`` (a file, or a folder of parquet
    files), ``model`` (a
    model folder with its config, weights and tokenizer; a ``.gguf`` file; or a hub id, for
    machines that may download), ``tokenizer`` (a folder with a tokenizer, or a hub id)."""

    role: str  # input or output
    kind: str


# what datasets' save_to_disk writes at the top of a folder: one dataset, or a dict of splits
DATASETS_FOLDER_FILES = {"state.json", "dataset_dict.json"}

INPUT_FILE = PathKind("input", "file")
INPUT_FOLDER = PathKind("input", "folder")
INPUT_DATA = PathKind("input", "data")
INPUT_FILE_OR_FOLDER = PathKind("input", "file or folder")
INPUT_MODEL = PathKind("input", "model")
INPUT_TOKENIZER = PathKind("input", "tokenizer")
OUTPUT_FOLDER = PathKind("output", "folder")

# The common declarations, by name.
PositiveInt = Annotated[int, Ge(1)]
NonNegativeInt = Annotated[int, Ge(0)]
PositiveFloat = Annotated[float, Gt(0)]
NonNegativeFloat = Annotated[float, Ge(0)]
Fraction = Annotated[float, Ge(0.0), Le(1.0)]
Seed = Annotated[int, Ge(0)]
Port = Annotated[int, Ge(1), Le(65535)]
InputFile = Annotated[str, INPUT_FILE]
InputFolder = Annotated[str, INPUT_FOLDER]
InputData = Annotated[str, INPUT_DATA]
InputFileOrFolder = Annotated[str, INPUT_FILE_OR_FOLDER]
ModelPath = Annotated[str, INPUT_MODEL]
TokenizerPath = Annotated[str, INPUT_TOKENIZER]
# where a run writes is not what it computes: a resumed run may name its folder another way
OutputFolder = Annotated[str, OUTPUT_FOLDER, FREE, NOT_BLANK]


def group(cls: type) -> type:
    """A group of settings: a dataclass whose numbers are validated as finite (pydantic reads
    ``__pydantic_config__`` from a standard dataclass). Every schema class uses it instead of
    ``@dataclass``."""
    cls.__pydantic_config__ = ConfigDict(allow_inf_nan=False)
    return dataclass(cls)


# ---------------------------------------------------------------------------------------------
# Reading declarations


@dataclass(frozen=True)
class Setting:
    """One declared setting: its dotted key, its plain type, its metadata, and whether it may be
    null. ``container`` is ``list`` or ``dict`` for a setting holding several values of the
    declared kind (each is checked), else None."""

    key: str
    type: Any
    metadata: tuple[Any, ...]
    optional: bool
    container: type | None = None

    def has(self, kind: type) -> bool:
        return any(isinstance(m, kind) for m in self.metadata)

    def first(self, kind: type):
        return next((m for m in self.metadata if isinstance(m, kind)), None)


def _unwrap(hint) -> tuple[Any, tuple[Any, ...], bool]:
    """(plain type, metadata, optional) of a type hint: ``Annotated[int, Ge(1)] | None`` ->
    (int, (Ge(1),), True)."""
    optional = False
    metadata: tuple[Any, ...] = ()
    while True:
        origin = typing.get_origin(hint)
        if origin is Annotated:
            metadata += hint.__metadata__
            hint = hint.__origin__
        elif origin in (typing.Union, types.UnionType):
            rest = [a for a in typing.get_args(hint) if a is not type(None)]
            optional = optional or len(rest) < len(typing.get_args(hint))
            if len(rest) != 1:
                return hint, metadata, optional
            hint = rest[0]
        else:
            return hint, metadata, optional


@functools.cache
def settings_of(schema: type, prefix: str = "") -> tuple[Setting, ...]:
    """Every leaf setting of a schema, nested groups walked; a group's own metadata (``FREE`` on
    a whole group) passes to its settings."""
    found: list[Setting] = []
    hints = typing.get_type_hints(schema, include_extras=True)
    for f in dataclasses.fields(schema):
        plain, metadata, optional = _unwrap(hints[f.name])
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(plain):
            found += [dataclasses.replace(s, metadata=s.metadata + metadata) for s in settings_of(plain, key + ".")]
            continue
        container = None
        origin = typing.get_origin(plain)
        if origin in (list, dict):
            container = origin
            element, element_metadata, _ = _unwrap(typing.get_args(plain)[-1])
            plain, metadata = element, metadata + element_metadata
        found.append(Setting(key, plain, metadata, optional, container))
    return tuple(found)


def free_keys(schema: type) -> tuple[str, ...]:
    """The keys a resumed run may change: those declared ``FREE``."""
    return tuple(s.key for s in settings_of(schema) if s.has(Free))


# ---------------------------------------------------------------------------------------------
# Checking values


@functools.cache
def _adapter(schema: type) -> TypeAdapter:
    return TypeAdapter(schema)


def _key(loc: tuple) -> str:
    key = ""
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key


def validate(schema: type, values: dict, derived: frozenset[str] = frozenset()) -> None:
    """Every value of a resolved config (a plain dict) within its declaration; the first that is
    not raises :class:`SettingError` naming its key, what it must be and what it is. Keys in
    ``derived`` (interpolations such as RL's ``engine.device: ${train.device}``) are named only
    when nothing else is wrong: the key a user set comes first."""
    try:
        _adapter(schema).validate_python(values)
    except ValidationError as error:
        problems = [e for e in error.errors() if e["type"] != "missing"] or error.errors()
        problems.sort(key=lambda e: _key(e["loc"]) in derived)
        first = problems[0]
        key = _key(first["loc"])
        declared = {s.key: s for s in settings_of(schema)}.get(key.split("[")[0])
        value = first.get("input")
        finite = not (isinstance(value, float) and not math.isfinite(value))
        whole = declared is not None and declared.container is list and key == declared.key  # the list itself, not one of its values
        reason = wanted(declared, finite, whole) if declared is not None else first["msg"].replace("Input should be", "must be")
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SettingError(key, f"{reason}, got {value!r}{more}") from None


def wanted(setting: Setting, finite: bool = True, whole: bool = False) -> str:
    """What a setting must be, in words, from its declaration: ``must be an integer >= 1 or
    null``, ``must be a number > 0 and <= 1``, ``must be one of hf, vllm, openai``; with
    ``whole``, what its list must be: ``must be a list of 2 values, each a number >= 0 and < 1``."""
    if whole:
        length = setting.first(Len)
        count = f"{length.min_length} " if length is not None and length.min_length == length.max_length else ""
        each = wanted(dataclasses.replace(setting, container=None, optional=False), finite).removeprefix("must be ")
        return f"must be a list of {count}values, each {each}"
    choice = setting.first(OneOf)
    if choice is not None:
        return f"must be one of {', '.join(map(str, choice.choices))}"
    if setting.type in (int, float):
        bounds = []
        for m in setting.metadata:
            if isinstance(m, Ge):
                bounds.append(f">= {m.ge}")
            elif isinstance(m, Gt):
                bounds.append(f"> {m.gt}")
            elif isinstance(m, Le):
                bounds.append(f"<= {m.le}")
            elif isinstance(m, Lt):
                bounds.append(f"< {m.lt}")
        what = "an integer" if setting.type is int else "a number" if finite else "a finite number"
        return f"must be {what}" + (f" {' and '.join(bounds)}" if bounds else "") + (" or null" if setting.optional else "")
    if setting.has(NotBlank):
        return "must be a path, not empty"
    return f"must be a {setting.type.__name__}" + (" or null" if setting.optional else "")


def _leaves(setting: Setting, value: Any) -> Iterator[tuple[str, Any]]:
    """(key, value) of each value a setting holds: itself, or each element of its list or dict."""
    if value is None:
        return
    if setting.container is list:
        yield from ((f"{setting.key}[{i}]", v) for i, v in enumerate(value))
    elif setting.container is dict:
        yield from ((f"{setting.key}.{k}", v) for k, v in value.items())
    else:
        yield setting.key, value


def _disabled(values: dict, key: str) -> bool:
    """Whether ``key`` lies in a group whose ``enabled`` is false (its stage does not read it)."""
    parts = key.split(".")
    node: Any = values
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
        if isinstance(node, dict) and node.get("enabled") is False:
            return True
    return False


def _select(values: dict, key: str) -> Any:
    node: Any = values
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def input_paths(schema: type, values: dict) -> list[tuple[str, str, str]]:
    """(key, path, kind) of every input a run reads, from the declarations, skipping null values
    and disabled groups. A model or tokenizer given as a hub id is not a local path: it is left
    out."""
    found = []
    for setting in settings_of(schema):
        kind = setting.first(PathKind)
        if kind is None or kind.role != "input" or _disabled(values, setting.key):
            continue
        for key, value in _leaves(setting, _select(values, setting.key)):
            if kind.kind in ("model", "tokenizer") and is_hub_id(value):
                continue
            found.append((key, str(value), kind.kind))
    # a path two settings name (RL's engine.model follows model) is one input, named by the
    # setting nearest the top: the one a user sets
    found.sort(key=lambda item: item[0].count("."))
    seen: set[tuple[str, str]] = set()
    unique = []
    for key, value, kind in found:
        if (value, kind) not in seen:
            seen.add((value, kind))
            unique.append((key, value, kind))
    return unique


def output_folders(schema: type, values: dict) -> list[tuple[str, str]]:
    """(key, path) of every output folder a run writes."""
    found = []
    for setting in settings_of(schema):
        kind = setting.first(PathKind)
        if kind is not None and kind.role == "output" and not _disabled(values, setting.key):
            found += [(key, str(value)) for key, value in _leaves(setting, _select(values, setting.key))]
    return found


def is_hub_id(value: str) -> bool:
    """``org/name`` that is not a local path: it does not start with ``.`` or ``/``, has one
    ``/``, and its first part is not a local folder (``runs/model`` is local when ``runs`` is)."""
    parts = str(value).split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not str(value).startswith((".", "/", "~"))
        and not Path(parts[0]).exists()
        and not Path(value).exists()
    )


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _path_problem(path: Path, kind: str) -> str | None:
    """Why ``path`` is not an input of ``kind``, or None when it is."""
    if kind == "data" and str(path).startswith("hf:"):  # a hub dataset (etagent.question_formats): read when the stage runs
        return None
    if not path.exists():
        return "does not exist"
    if kind == "file" and not path.is_file():
        return "is a folder, not a file"
    if kind == "folder" and not path.is_dir():
        return "is a file, not a folder"
    if (
        kind == "data"
        and path.is_dir()
        and not any(path.glob("*.parquet"))
        and not DATASETS_FOLDER_FILES & {p.name for p in path.iterdir()}
    ):
        return "is a folder with no parquet files and not a `datasets` save_to_disk folder, not a data file"
    if kind == "model" and path.is_file():
        return None if path.suffix == ".gguf" else "is a file, not a model folder (or a .gguf file)"
    if kind in ("model", "tokenizer"):
        if not path.is_dir():
            return f"is not a {kind} folder"
        if kind == "model":
            config = path / "config.json"
            if not config.is_file():
                return "has no config.json (not a model folder)"
            try:
                read_json_file(config)
            except RecordError as exc:
                return f"has a config.json that is not valid JSON ({exc.message}, line {exc.line})"
            if not any((path / name).is_file() for name in WEIGHT_FILES) and not any(path.glob("*.safetensors")):
                return f"has no weights ({', '.join(WEIGHT_FILES)})"
            for weights in sorted(path.glob("*.safetensors")):
                problem = _safetensors_problem(weights)
                if problem:
                    return f"has weights that cannot be read: {weights.name} {problem}"
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            return f"has no tokenizer ({' or '.join(TOKENIZER_FILES)})"
        for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer that will not load
            if (path / name).is_file():
                try:
                    read_json_file(path / name)
                except RecordError as exc:
                    return f"has a {name} that is not valid JSON ({exc.message}, line {exc.line})"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file is not whole (its header, read alone, says how long its tensors
    are), or None: a file cut short is refused before a model loads, not inside transformers."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        header_bytes = int.from_bytes(head, "little") if len(head) == 8 else -1
        if header_bytes < 2 or 8 + header_bytes > size:
            return "is not a safetensors file (its header is cut or missing)"
        try:
            header = decode_json(f.read(header_bytes), path)
        except RecordError:
            return "has a header that is not valid JSON"
    if not isinstance(header, dict):
        return "has a header that is not a JSON object"
    ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__" and isinstance(t, dict) and "data_offsets" in t]
    if ends and 8 + header_bytes + max(ends) > size:
        return f"is cut short ({size} bytes, its header says {8 + header_bytes + max(ends)})"
    return None


def _stored_shapes(folder: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]] | None:
    """(name -> shape, name -> file) of every tensor of a folder's safetensors weights (one
    ``model.safetensors``, or the shards its index names), read from the files' headers alone
    (safetensors' ``safe_open``: no tensor is loaded); None where the weights are not
    safetensors (``pytorch_model.bin``: its names are not read here)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_weight_map(index).values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    shapes, where = {}, {}
    for name in files:
        with safe_open(folder / name, framework="pt") as weights:
            for tensor in weights.keys():  # noqa: SIM118 -- safe_open is no mapping
                shapes[tensor] = tuple(weights.get_slice(tensor).get_shape())
                where[tensor] = name
    return shapes, where


def read_weight_map(index: Path) -> dict[str, str]:
    """A safetensors index's ``weight_map`` (tensor name -> shard file)."""
    content = read_json_file(index)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index.name} has no weight_map of tensor names to files")
    return weight_map


def model_on_meta(folder: str | Path):
    """The causal LM that ``folder``'s config.json describes, built on the meta device (no memory,
    no weights), as transformers builds it before it loads the weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@functools.lru_cache(maxsize=16)
def _weights_problem(folder: str, stamp: tuple) -> str | None:
    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(read_weight_map(index).values()))
        except ValueError as exc:  # RecordError is one
            return f"has a {index.name} that cannot be read ({str(exc)[:200]})"
        absent = [name for name in shards if not (Path(folder) / name).is_file()]
        if absent:
            return f"has a {index.name} that names {len(absent)} shard(s) not in the folder ({', '.join(absent[:3])})"
    stored = _stored_shapes(Path(folder))
    config = read_json_file(Path(folder) / "config.json")
    if stored is None or "quantization_config" in config:
        return None  # the names of .bin weights are not read; a quantized model stores other tensors than it computes with
    shapes, where = stored
    try:
        lm = model_on_meta(folder)
    except (ValueError, KeyError, OSError) as exc:  # a model type transformers does not know, or not a causal LM
        return f"has a config.json that transformers cannot build a causal language model from ({str(exc).strip().splitlines()[0]})"
    # the names one parameter goes by: a tied output layer is the input embedding's, and a
    # checkpoint may hold it under either name (save_pretrained leaves the tied one out)
    aliases: dict[int, list[str]] = {}
    expected: dict[str, tuple[int, ...]] = {}
    for name, parameter in lm.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
        expected[name] = tuple(parameter.shape)
    prefix = lm.base_model_prefix
    named = {}  # each stored name as the model names it (a base model's checkpoint lacks the prefix)
    for name in shapes:
        named[name] = name if name in expected or f"{prefix}.{name}" not in expected else f"{prefix}.{name}"
    for stored_name, name in named.items():
        if name in expected and shapes[stored_name] != expected[name]:
            return (
                f"has weights that do not fit its config.json: {stored_name} is {list(shapes[stored_name])} in "
                f"{where[stored_name]}, and the model its config.json describes needs {list(expected[name])}"
            )
    if any(name not in expected for name in named.values()):
        # a layout transformers converts as it loads (an MoE's experts one by one, renamed keys):
        # the names are not the model's, so which are missing is not read from them
        return None
    present = set(named.values())
    missing = [names[0] for names in aliases.values() if not present & set(names)]
    if missing:
        return (
            f"has weights that are missing {len(missing)} of the {len(aliases)} tensors its config.json's model needs "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): transformers would start them at random. "
            "Copy the model folder again, or save it with save_pretrained"
        )
    return None


def model_weights_problem(folder: str | Path) -> str | None:
    """Why a ``save_pretrained`` folder's weights do not make the model its config.json
    describes, or None: every parameter of that model (built on the meta device) stored in its
    safetensors under its name (a tied output layer may be left out, as save_pretrained leaves
    it), each of the shape the config gives it. Only the files' headers are read. Not checked:
    ``pytorch_model.bin`` weights, quantized models, and which names are missing from weights in
    a layout that transformers converts as it loads (names the model lacks: their shapes are
    checked where the names are the model's). Transformers itself only warns about a missing
    weight and starts it at random; a stage refuses it before it writes anything. The answer is
    kept per folder while its files stay as they are."""
    folder = Path(folder)
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors")), folder / "model.safetensors.index.json"]
    stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.is_file())
    return _weights_problem(str(folder.resolve()), stamp)


def check_device(key: str, device: str) -> None:
    """A setting that asks for ``cuda`` on a machine where torch sees no CUDA device is refused
    (``auto`` takes what there is)."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise SettingError(key, f"is cuda, and this machine has no CUDA device that torch can use ({build}): set {key}=cpu")


def check_installed(key: str, module: str, why: str, install: str | None = None) -> None:
    """A setting whose value needs an optional package (``module``) that is not installed is
    refused, saying how to install it: ``install``, or the extra that installs it
    (etagent.errors.EXTRAS)."""
    if importlib.util.find_spec(module) is not None:
        return
    extra = EXTRAS.get(module)
    how = install or (f"pip install 'etagent[{extra}]'" if extra else f"pip install {module}")
    raise SettingError(key, f"{why} needs the {module} package, which is not installed here ({how})")


def check_attention(key: str, implementation: str) -> None:
    """``flash_attention_2`` needs the flash-attn package, which builds on a GPU machine only;
    sdpa and eager need nothing."""
    if implementation == "flash_attention_2":
        check_installed(
            key,
            "flash_attn",
            "flash_attention_2",
            install=f"pip install flash-attn --no-build-isolation on a GPU machine, or set {key}=sdpa",
        )


def _overlap(a: Path, b: Path) -> str | None:
    """How two paths overlap, or None."""
    if a == b:
        return "is"
    if a in b.parents:
        return "contains"
    if b in a.parents:
        return "lies inside"
    return None


def check_paths(schema: type, values: dict) -> list[tuple[str, str, str]]:
    """Before any work: every input of the kind its declaration says, and the outputs apart from
    the inputs (:func:`check_apart`). Reads files' headers only: a refusal here answers in about a
    second. Returns the inputs (key, path, kind)."""
    inputs = input_paths(schema, values)
    for key, value, kind in inputs:
        problem = _path_problem(Path(value), kind)
        if problem == "does not exist":
            raise SettingError(
                key, f"no {kind} at {value!r}" + (" (build the toy model with `etagent toy build`)" if kind == "model" else "")
            )
        if problem:
            raise SettingError(key, f"{value!r} {problem}")
    check_apart(schema, values)
    return inputs


def check_model_weights(schema: type, values: dict) -> None:
    """Each model folder's weights against its config (:func:`model_weights_problem`). It imports
    torch and transformers (seconds), so a stage's plan runs it after every check that does not,
    its data read included."""
    for key, value, kind in input_paths(schema, values):
        problem = model_weights_problem(value) if kind == "model" and Path(value).is_dir() else None
        if problem:
            raise SettingError(key, f"{value!r} {problem}")


def check_apart(schema: type, values: dict) -> None:
    """No output folder that equals, contains or lies inside an input: a run never writes over,
    or moves, what it reads."""
    inputs = input_paths(schema, values)
    for out_key, out_value in output_folders(schema, values):
        out = Path(out_value).resolve()
        for key, value, _ in inputs:
            how = _overlap(out, Path(value).resolve())
            if how:
                raise SettingError(
                    out_key, f"{out_value!r} {how} the input {key}={value!r}: outputs never overwrite inputs; write elsewhere"
                )


def out_of_range_values(setting: Setting) -> list[Any]:
    """Values the declaration refuses, one per bound or choice, plus NaN and infinities for
    numbers: what tests feed every setting to see that each is refused at load."""
    values: list[Any] = []
    if setting.type in (int, float) and setting.type is not bool:

        def past(bound, direction: int):  # the nearest value on the wrong side (0.5 vanishes next to 1e37)
            return bound + direction if setting.type is int else bound + direction * max(0.5, abs(bound) * 1e-6)

        for m in setting.metadata:
            if isinstance(m, Ge):
                values.append(past(m.ge, -1))
            elif isinstance(m, Gt):
                values.append(m.gt)
            elif isinstance(m, Le):
                values.append(past(m.le, 1))
            elif isinstance(m, Lt):
                values.append(m.lt)
        if not any(m == NON_FINITE_OK for m in setting.metadata):
            values += [math.nan, math.inf, -math.inf]
    choice = setting.first(OneOf)
    if choice is not None:
        values.append("not-" + "-".join(map(str, choice.choices)))
    if setting.has(NotBlank):
        values += ["", "  "]
    return values
