"""Every stage plans before it writes (docs/design.md 4c): whatever it can refuse, it refuses before
it claims its output folder, so a refused run leaves the folder as it was and the corrected rerun
needs no ``--restart``.

The walk, per stage: the keys the stage's plan can refuse are read from the plan's own code (each
``SettingError``, ``check_installed`` and ``check_device`` in it, in the stage's functions it calls
and in the shared planning modules: the engine's, the tools' and the sampling's checks), and a
probe per key is required (a new check without one fails the test). A corrected run first claims
``out_dir`` (the stage's plan, then ``claim_output``: a ``running`` manifest, as a killed run
leaves); each probe then runs the stage's command line in this process (its ``main(argv)``) on
that folder, and must end with exit 2, one line naming the key, and the folder byte for byte as it
was; the corrected run is claimed again, without ``--restart``. A package a probe needs missing is
made missing the way Python documents it: ``None`` in ``sys.modules``.

Then: a model missing a weight, or holding one of another shape (safetensors' own ``save_file``;
one file and an index of shards), refused by evaluation and RL; ``--restart`` moving only what a
stage wrote, and nothing of a run its plan refuses; a hand-edited manifest refused on resume."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from etagent.config import SCHEMAS, load_settings
from etagent.records import RLRow, write_manifest, write_rl_parquet

# The shared modules whose checks a stage's plan runs (the engine's, the tools', the sampling's);
# every other module's own refusals (the question readers', the path checks') are tested where
# they live.
PLANNING_MODULES = ("etagent.llm", "etagent.tools.executor", "etagent.sampling")
CHECKS = {"SettingError", "check_installed", "check_device"}


def _key_pattern(node: ast.expr) -> str | None:
    """The key a check names, as a glob (``*`` where an f-string inserts a value), or None where
    the key is a variable (a check that names the key its caller gives)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "*" for part in node.values)
    return None


def refusal_keys(function, package: str, seen: set | None = None) -> set[str]:
    """Every key ``function`` can refuse, following the calls into the functions of ``package``
    (the stage's) and of :data:`PLANNING_MODULES`."""
    seen = set() if seen is None else seen
    if function in seen:
        return set()
    seen.add(function)
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names = dict(function.__globals__)
    for node in ast.walk(tree):  # imports inside the function (the stages import late)
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            names.update({alias.asname or alias.name: getattr(module, alias.name) for alias in node.names if hasattr(module, alias.name)})
    keys = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        if node.func.id in CHECKS and node.args and (key := _key_pattern(node.args[0])) is not None:
            keys.add(key)
        called = names.get(node.func.id)
        if inspect.isfunction(called) and called.__module__.startswith((package, *PLANNING_MODULES)):
            keys |= refusal_keys(called, package, seen)
    return keys


def matches(pattern: str, key: str) -> bool:
    return re.fullmatch(".+".join(map(re.escape, pattern.split("*"))), key) is not None


def snapshot(folder: Path) -> dict[str, str] | None:
    """Every file under ``folder`` with the sha256 of its bytes (None where there is no folder)."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir" for p in folder.rglob("*")}


class Probe:
    """Overrides that a stage's plan refuses: ``key`` is the setting the one line names (or,
    for a refusal of an input, a piece of the line); ``env`` and ``missing`` (packages made
    missing) are the machine it runs on."""

    def __init__(self, key: str, *overrides: str, env: dict | None = None, missing: tuple[str, ...] = (), says: str | None = None):
        self.key, self.overrides, self.env, self.missing, self.says = key, list(overrides), env or {}, missing, says

    def __repr__(self) -> str:
        return f"{self.key}: {' '.join(self.overrides)}"


def refused_as_planned(main, argv: list[str], probe: Probe, out: Path, monkeypatch, capsys) -> None:
    """The stage's command line with the probe's overrides: exit 2, one line naming the key, no
    traceback, and ``out`` as it was."""
    before = snapshot(out)
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.delenv("RANK", raising=False)
        patch.delenv("WORLD_SIZE", raising=False)
        for name, value in probe.env.items():
            patch.setenv(name, value)
        for name in probe.missing:
            patch.setitem(sys.modules, name, None)
        with pytest.raises(SystemExit) as exit:
            main(argv + probe.overrides)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit.value.code == 2, (probe, err[-2000:])
    assert len(lines) == 1 and "Traceback" not in err, (probe, err[-2000:])
    if probe.says is None:
        assert lines[0].startswith(f"error: setting {probe.key}: "), (probe, lines[0])
    else:
        assert probe.says in lines[0], (probe, lines[0])
    assert snapshot(out) == before, probe


def claim(stage: str, argv: list[str], plan) -> dict:
    """The corrected run's plan and claim, as ``run`` does them; the manifest it leaves."""
    from etagent.rundir import claim_output

    cfg = load_settings(stage, "tiny", argv)
    plan(cfg)
    values = dataclasses.asdict(cfg)
    folder = values["index_dir" if stage == "retriever" else "out_dir"]
    with claim_output(folder, stage=stage, schema=SCHEMAS[stage][0], config=values) as out:
        return json.loads((out / "manifest.json").read_text())


def walk(stage: str, module, argv: list[str], out: Path, probes: list[Probe], monkeypatch, capsys, plan=None) -> None:
    """Every key the stage's plan can refuse has a probe; each probe is refused with the folder
    of a claimed run untouched; the corrected run is claimed again without --restart."""
    plan = plan or module.plan
    package = module.__name__.rpartition(".")[0]
    keys = refusal_keys(plan, package)
    unprobed = sorted(k for k in keys if not any(matches(k, p.key) for p in probes))
    assert not unprobed, f"{stage}: no probe for {unprobed}"
    assert claim(stage, argv, plan)["status"] == "running"
    for probe in probes:
        refused_as_planned(module.main, argv, probe, out, monkeypatch, capsys)
    assert claim(stage, argv, plan)["status"] == "running"  # the same settings resume: no --restart


def cuda_probes(*keys: str) -> list[Probe]:
    """``cuda`` asked for where torch sees none (none on a machine that has one)."""
    import torch

    return [] if torch.cuda.is_available() else [Probe(key, f"{key}=cuda") for key in keys]


# an outside harness instead of the agent loop (the stages that sample: etagent.sampling.check_harness)
HARNESS_PROBES = [
    Probe("gateway.harness", "gateway.harness='no-such-harness --tasks'"),
    Probe("gateway.harness", "gateway.harness=sh", missing=("uvicorn",)),
    Probe("ray.workers", "gateway.harness=sh", "ray.workers=2"),
]

TOOL_PROBES = [
    Probe("tools.search.web.api_key_env", "tools.search.backend=serper", "tools.search.web.api_key_env=ETAGENT_TEST_UNSET_KEY"),
    Probe("tools.python.sandbox_fusion_url", "tools.python.backend=sandbox_fusion", "tools.python.sandbox_fusion_url=null"),
    Probe("tools.search.cache.path", "tools.search.cache.path=/nonexistent/cache.sqlite", "tools.search.cache.mode=replay"),
]


# --- the inputs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(toy, tmp_path_factory) -> dict[str, Path]:
    """Small real inputs beside the toy world: an RL parquet of 8 prompts, 64 SFT examples, a
    DeepSpeed config, copies of the toy model missing a weight and holding one of another shape."""
    from etagent.question_formats import read_questions

    folder = tmp_path_factory.mktemp("plan-inputs")
    questions = read_questions(toy / "questions" / "rl.jsonl")[:8]
    parquet = write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(questions)], folder / "rl.parquet")
    sft = folder / "sft.jsonl"
    sft.write_text("".join((toy / "sft.jsonl").read_text().splitlines(keepends=True)[:64]))
    deepspeed = folder / "ds_zero3.json"
    deepspeed.write_text('{"zero_optimization": {"stage": 3}}')
    return {
        "rl.parquet": parquet,
        "sft.jsonl": sft,
        "deepspeed": deepspeed,
        "missing weight": broken_model(toy / "model", folder / "missing-weight", "missing"),
        "wrong shape": broken_model(toy / "model", folder / "wrong-shape", "shape"),
    }


def broken_model(model: Path, folder: Path, how: str) -> Path:
    """A copy of ``model`` whose model.safetensors, rewritten with safetensors' own save_file,
    lacks one tensor (``missing``) or holds one of another shape (``shape``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder)
    weights = load_file(folder / "model.safetensors")
    if how == "missing":
        del weights["model.layers.1.mlp.down_proj.weight"]
    else:
        weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


# --- one walk per stage ---------------------------------------------------------------------------


def test_rl_refuses_before_it_claims(toy, inputs, tmp_path, monkeypatch, capsys):
    from etagent.rl import run as rl

    out = tmp_path / "rl"
    argv = [
        f"model={toy / 'model'}",
        f"data.train={inputs['rl.parquet']}",
        f"out_dir={out}",
        "tools.search.local.url=http://127.0.0.1:9",
        "data.prompts_per_step=4",
        "rollout.n=4",
        "train.mini_batch_prompts=2",
    ]
    vllm = importlib.util.find_spec("vllm") is not None  # the vllm engine's own checks come after its package's
    probes = [
        Probe("rollout.initial_rollouts", "rollout.kind=tree", "rollout.initial_rollouts=8"),
        Probe("algorithm.tis_cap", "rollout.partial=true", "rollout.stale_tokens=tis", "algorithm.tis_cap=null"),
        Probe(
            "rollout.max_staleness", "rollout.partial=true", "rollout.on_stale=wait", "rollout.partial_extra=8", "rollout.max_staleness=1"
        ),
        Probe("lora.dropout", "lora.enabled=true", "lora.dropout=0.1"),
        Probe("rollout.top_logprobs", "rollout.kind=tree", "rollout.top_logprobs=0"),
        Probe("rollout.gateway.harness", "rollout.kind=gateway"),  # no harness
        Probe("rollout.gateway.harness", "rollout.kind=gateway", "rollout.gateway.harness='no-such-harness --x'"),
        Probe("rollout.partial", "rollout.kind=gateway", "rollout.gateway.harness=sh", "rollout.partial=true"),
        Probe("rollout.gateway.harness", "rollout.kind=gateway", "rollout.gateway.harness=sh", missing=("uvicorn",)),
        *[Probe(f"agent.sampling.{key}", f"agent.sampling.{key}={value}") for key, value in TRUNCATING_SAMPLING],
        Probe("agent.sampling.temperature", "agent.sampling.temperature=0"),
        Probe("engine.kind", "engine.kind=openai"),
        Probe("engine.kind", "engine.kind=vllm", missing=("vllm",)),
        *cuda_probes("train.device"),
        Probe(
            "train.attn_implementation",
            "train.share_prefixes=false",
            "train.attn_implementation=flash_attention_2",
            missing=("flash_attn",),
        ),
        Probe("train.share_prefixes", "train.share_prefixes=true", "train.attn_implementation=flash_attention_2"),
        Probe("wandb.enabled", "wandb.enabled=true", missing=("wandb",)),
        Probe("data.prompts_per_step", "data.prompts_per_step=3"),  # not a multiple of the mini-batch
        Probe("data.prompts_per_step", env={"WORLD_SIZE": "3"}),  # not a multiple of the processes
        Probe("train.mini_batch_prompts", "rollout.n=3", "rollout.initial_rollouts=2", env={"WORLD_SIZE": "4"}),  # 2 x 3 over 4
        Probe("data.prompts_per_step", "data.prompts_per_step=16", "train.mini_batch_prompts=4"),  # more than the 8 prompts
        *TOOL_PROBES,
        Probe("lora.target_modules[0]", "lora.enabled=true", "lora.dropout=0", "lora.target_modules=[nope_proj]"),
        Probe("lora.target_modules", "lora.enabled=true", "lora.dropout=0", "lora.target_modules=[mlp]"),
        Probe("lora.target_modules", "lora.enabled=true", "lora.dropout=0", "lora.target_modules=[]"),
        Probe("model", f"model={inputs['missing weight']}"),
        Probe("model", f"model={inputs['wrong shape']}"),
        Probe("data.max_prompt_tokens", "data.max_prompt_tokens=4", says="over data.max_prompt_tokens (4)"),
        # refused by the declarations, at load
        Probe("optim.betas", "optim.betas=[0.9]"),
        Probe("out_dir", "out_dir=''"),
    ]
    if vllm:
        probes += [
            Probe("engine.kind", "engine.kind=vllm"),  # one engine per rank: under torchrun only
            Probe("rollout.entropy", "engine.kind=vllm", "rollout.kind=tree", "rollout.entropy=exact"),
            Probe("lora.rank", "engine.kind=vllm", "lora.enabled=true", "lora.dropout=0", "lora.rank=1024"),
            Probe("rollout.top_logprobs", "engine.kind=vllm", "rollout.top_logprobs=21"),
            Probe("engine.vllm.tensor_parallel_size", "engine.kind=vllm", "engine.vllm.tensor_parallel_size=2"),
            Probe("algorithm.tis_cap", "engine.kind=vllm", "algorithm.tis_cap=2", "agent.sampling.temperature=0.7", env={"RANK": "0"}),
        ]
    walk("rl", rl, argv, out, probes, monkeypatch, capsys)


TRUNCATING_SAMPLING = [("top_p", 0.9), ("top_k", 20), ("min_p", 0.1), ("repetition_penalty", 1.1)]


def test_sft_refuses_before_it_claims(toy, inputs, tmp_path, monkeypatch, capsys):
    from etagent.sft import run as sft

    out = tmp_path / "sft"
    argv = [f"model={toy / 'model'}", f"data.path={inputs['sft.jsonl']}", f"out_dir={out}", "train.max_steps=1", "threads=1"]
    probes = [
        Probe("train.max_steps", "train.max_steps=0"),
        Probe("train.packing", "train.packing=true"),
        Probe("train.fsdp", "train.fsdp=full_shard", f"train.deepspeed={inputs['deepspeed']}"),
        Probe("train.fsdp", "train.fsdp=full_shard"),  # not under torchrun
        Probe("attn_implementation", "attn_implementation=flash_attention_2", missing=("flash_attn",)),
        Probe("train.deepspeed", f"train.deepspeed={inputs['deepspeed']}", missing=("deepspeed",)),
        Probe("wandb.enabled", "wandb.enabled=true", missing=("wandb",)),
        Probe("lora.target_modules[0]", "lora.enabled=true", "lora.target_modules=[nope_proj]"),
        Probe("model", f"model={inputs['missing weight']}"),
        Probe("cutoff_len", "cutoff_len=5", says="no example left to train on"),
        Probe("data.format", "data.format=csv"),  # refused at load by its declaration, before load_examples' own check
        Probe("out_dir", "out_dir=' '"),
    ]
    walk("sft", sft, argv, out, probes, monkeypatch, capsys)


def engine_probes(prefix: str = "engine", *enable: str) -> list[Probe]:
    """What an engine group asks of the machine: CUDA, vLLM's package, an openai engine's URLs."""
    return [
        *[Probe(p.key, *enable, f"{prefix}.kind=hf", *p.overrides) for p in cuda_probes(f"{prefix}.device")],
        Probe(f"{prefix}.kind", *enable, f"{prefix}.kind=vllm", missing=("vllm",)),
        Probe(f"{prefix}.openai.urls", *enable, f"{prefix}.kind=openai", f"{prefix}.openai.urls=[]"),
    ]


def test_flywheel_refuses_before_it_claims(toy, inputs, tmp_path, monkeypatch, capsys):
    from etagent.flywheel import run as flywheel

    out = tmp_path / "flywheel"
    argv = [f"model={toy / 'model'}", f"questions={toy / 'questions' / 'rl.jsonl'}", f"out_dir={out}", "limit=2"]
    editor = ("editor.enabled=true", f"editor.engine.model={toy / 'model'}")
    probes = [
        Probe("editor.engine.model", "editor.enabled=true", "editor.engine.model=null"),
        Probe("editor.enabled", "judge.llm=true"),
        *engine_probes(),
        *engine_probes("editor.engine", *editor),
        *TOOL_PROBES,
        Probe("model", f"model={inputs['wrong shape']}"),
        Probe("out_dir", "out_dir=''"),
    ]
    walk("flywheel", flywheel, argv, out, probes, monkeypatch, capsys)


def test_direct_rollout_refuses_before_it_claims(toy, inputs, tmp_path, monkeypatch, capsys):
    from etagent.direct_rollout import run as direct_rollout

    out = tmp_path / "rollouts"
    argv = [f"model={toy / 'model'}", f"questions={toy / 'questions' / 'rl.jsonl'}", f"out_dir={out}", "limit=2"]
    probes = [
        *engine_probes(),
        Probe("ray.workers", "ray.workers=2", missing=("ray",)),
        *TOOL_PROBES,
        *HARNESS_PROBES,
        Probe("model", f"model={inputs['missing weight']}"),
        Probe("out_dir", "out_dir=''"),
    ]
    walk("direct_rollout", direct_rollout, argv, out, probes, monkeypatch, capsys)


def test_evaluation_refuses_before_it_claims(toy, inputs, tmp_path, monkeypatch, capsys):
    from etagent.evaluation import run as evaluation

    out = tmp_path / "eval"
    argv = [f"model={toy / 'model'}", f"files.toy={toy / 'questions' / 'test.jsonl'}", f"out_dir={out}", "limit=2"]
    probes = [
        Probe("datasets", "datasets=[]"),
        Probe("datasets", "datasets=[nope]"),
        Probe("splits.other", "+splits.other=test"),
        Probe("kinds.toy", "+kinds.toy=math"),
        *engine_probes(),
        *engine_probes("judge.engine", "judge.enabled=true"),
        Probe("ray.workers", "ray.workers=2", missing=("ray",)),
        *TOOL_PROBES,
        *HARNESS_PROBES,
        Probe("model", f"model={inputs['missing weight']}"),
        Probe("model", f"model={inputs['wrong shape']}"),
        Probe("out_dir", "out_dir=''"),
    ]
    walk("evaluation", evaluation, argv, out, probes, monkeypatch, capsys)


def rollouts_folder(folder: Path, lines: list[dict] | None = None, status: str = "complete") -> Path:
    """A direct rollout's folder as Pareto reads it: trajectories.jsonl and its manifest (by
    default four questions whose chains disagree)."""
    from tests.support.trajectories import rollout_line

    lines = lines if lines is not None else [rollout_line(f"q{i}", "qa", [(0.0, 1), (1.0, 2)]) for i in range(4)]
    folder.mkdir()
    (folder / "trajectories.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    write_manifest(folder, stage="direct_rollout/stage1", config={}, started_at=0, status=status)
    return folder


def test_pareto_refuses_before_it_claims(tmp_path, monkeypatch, capsys):
    from etagent.pareto import run as pareto
    from tests.support.trajectories import rollout_line

    good = rollouts_folder(tmp_path / "rollouts")
    out = tmp_path / "pareto"
    argv = [f"rollouts={good}", f"out_dir={out}", "count=2"]
    probes = [
        Probe("objectives", "objectives=[]"),
        Probe("rollouts", f"rollouts={rollouts_folder(tmp_path / 'unfinished', status='running')}", says="has not finished"),
        Probe("rollouts", f"rollouts={rollouts_folder(tmp_path / 'degraded', status='degraded')}", says="the direct rollout is degraded"),
        Probe(
            "rollouts", f"rollouts={rollouts_folder(tmp_path / 'agreeing', [rollout_line('a', 'qa', [(1.0, 1)] * 2)])}", says="is eligible"
        ),
        Probe("matplotlib", missing=("matplotlib",), says="this needs matplotlib, from the 'charts' extra"),
        Probe("out_dir", "out_dir=''"),
    ]
    walk("pareto", pareto, argv, out, probes, monkeypatch, capsys)


@pytest.fixture(scope="module")
def evaluated(toy, tmp_path_factory) -> Path:
    """A real evaluation of two toy questions (one sample each): what the radar reads."""
    from etagent.evaluation.run import main as evaluate

    out = tmp_path_factory.mktemp("evaluated") / "eval"
    evaluate(
        [
            f"model={toy / 'model'}",
            f"files.toy={toy / 'questions' / 'test.jsonl'}",
            f"out_dir={out}",
            "limit=2",
            "n=1",
            "agent.max_response_tokens=16",
            "tools.search.local.url=http://127.0.0.1:9",
            "tools.search.attempts=1",
            "tools.max_failure_share=1",
            "bootstrap_rounds=10",
        ]
    )
    return out


def test_radar_refuses_before_it_claims(toy, evaluated, tmp_path, monkeypatch, capsys):
    from etagent.radar import run as radar

    out = tmp_path / "radar"
    not_evaluated = tmp_path / "not-evaluated"
    not_evaluated.mkdir()
    nothing_in_it = tmp_path / "nothing-in-it"
    nothing_in_it.mkdir()
    (nothing_in_it / "summary.json").write_text(json.dumps({"run": "empty"}))
    no_needs = tmp_path / "no-needs"  # questions from outside a toy world: nothing says what they need
    shutil.copytree(evaluated, no_needs)
    trajectories = no_needs / "toy" / "trajectories.jsonl"
    lines = [json.loads(line) for line in trajectories.read_text().splitlines()]
    trajectories.write_text("".join(json.dumps({**line, "needed_calls": None}) + "\n" for line in lines))
    argv = [f"runs=[{evaluated}]", f"tokenizer={toy / 'model'}", "judge.mode=toy_oracle", f"out_dir={out}"]
    probes = [
        Probe("runs", "runs=[]"),
        Probe("runs[0]", f"runs=[{not_evaluated}]"),
        Probe("runs[1]", f"runs=[{evaluated},{nothing_in_it}]", "labels=[a,b]"),
        Probe("labels", "labels=[a,b]"),
        Probe("labels[1]", f"runs=[{evaluated},{evaluated}]", "labels=[a,a]"),
        Probe("datasets[0]", "datasets=[../eval]"),
        Probe("datasets", "datasets=[nope]", says="no such file (was nope evaluated in"),
        Probe("judge.mode", f"runs=[{no_needs}]"),
        *engine_probes("judge.engine", "judge.mode=llm"),
        Probe("matplotlib", missing=("matplotlib",), says="this needs matplotlib, from the 'charts' extra"),
        Probe("out_dir", "out_dir=''"),
    ]
    walk("radar", radar, argv, out, probes, monkeypatch, capsys)


def test_retriever_build_refuses_before_it_claims(toy, tmp_path, monkeypatch, capsys):
    from etagent.retriever import build

    out = tmp_path / "index"
    argv = [f"corpus={toy / 'corpus.jsonl'}", f"index_dir={out}"]
    static = tmp_path / "static-embeddings"  # a sentence-transformers model with no transformer to export
    static.mkdir()
    (static / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.StaticEmbedding"}]))
    probes = [
        Probe("encoder.model", f"encoder.model={tmp_path / 'no-encoder'}"),
        *[Probe(p.key, *p.overrides, "encoder.runtime=torch") for p in cuda_probes("encoder.device")],
        Probe("encoder.kind", missing=("sentence_transformers",)),
        Probe("encoder.runtime", "encoder.device=cuda"),  # onnxruntime runs on the CPU here, GPU or not
        Probe("encoder.runtime", f"encoder.model={static}"),
        Probe("encoder.runtime", missing=("onnxruntime",)),
        Probe("encoder.runtime", missing=("onnx",)),
        Probe("faiss", missing=("faiss",), says="this needs faiss, from the 'retriever' extra"),
        Probe("build.ivf_lists", "build.index_type=IVF-PQ", "build.ivf_lists=64"),  # 360 passages, 39 per list
        Probe("index_dir", "index_dir=''"),
    ]
    walk("retriever", build, argv, out, probes, monkeypatch, capsys)


# --- a model missing a weight ---------------------------------------------------------------------


def sharded(model: Path, folder: Path, drop: str | None = None, reshape: str | None = None) -> Path:
    """``model`` saved by transformers in shards with an index; then ``drop`` removed from, or
    ``reshape`` cut short in, the shard that holds it (safetensors' own load_file and save_file)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(model, folder)
    (folder / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(model).save_pretrained(folder, max_shard_size="400KB")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    for name in filter(None, (drop, reshape)):
        shard = folder / weight_map[name]
        weights = load_file(shard)
        if name == drop:
            del weights[name]
        else:
            weights[name] = weights[name][:-1].clone()
        save_file(weights, shard, metadata={"format": "pt"})
    return folder


def test_a_model_missing_a_weight_or_of_another_shape_is_refused(toy, inputs, tmp_path):
    """Read from the files' headers against the model the config describes (built on the meta
    device): one file or an index of shards; the tied output layer may be absent, and may be
    present."""
    from safetensors.torch import load_file, save_file

    from etagent.settings import model_weights_problem

    assert model_weights_problem(toy / "model") is None
    assert "missing 1 of the 50 tensors" in model_weights_problem(inputs["missing weight"])
    assert "model.layers.1.mlp.down_proj.weight" in model_weights_problem(inputs["missing weight"])
    assert "model.norm.weight is [127]" in model_weights_problem(inputs["wrong shape"])
    tied = tmp_path / "tied-present"
    shutil.copytree(toy / "model", tied)
    weights = load_file(tied / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    assert model_weights_problem(tied) is None
    assert model_weights_problem(sharded(toy / "model", tmp_path / "shards")) is None
    dropped = sharded(toy / "model", tmp_path / "shard-missing", drop="model.layers.3.self_attn.v_proj.weight")
    assert "model.layers.3.self_attn.v_proj.weight" in model_weights_problem(dropped)
    cut = sharded(toy / "model", tmp_path / "shard-cut", reshape="model.layers.0.input_layernorm.weight")
    assert "model.layers.0.input_layernorm.weight is [127]" in model_weights_problem(cut)
    gone = sharded(toy / "model", tmp_path / "shard-gone")
    next(gone.glob("model-0000*-of-*.safetensors")).unlink()
    assert "names 1 shard(s) not in the folder" in model_weights_problem(gone)


# --- --restart and the manifest -------------------------------------------------------------------


def test_restart_moves_only_what_a_stage_wrote(tmp_path, capsys):
    """A folder of the user's own files is refused and nothing moves; a run whose plan refuses it
    moves nothing; a stage's folder is moved aside whole, and the stage starts over."""
    from etagent.pareto.run import main

    argv = [f"rollouts={rollouts_folder(tmp_path / 'rollouts')}", "count=2"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    (mine / "manifest.json").write_text('{"name": "another program\'s manifest"}')
    with pytest.raises(SystemExit) as exit:
        main(["--restart", *argv, f"out_dir={mine}"])
    assert exit.value.code == 2 and "--restart moves aside only what a stage wrote" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "rollouts"] and (mine / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in mine.iterdir()) == ["manifest.json", "notes.txt"]

    out = tmp_path / "pareto"
    main([*argv, f"out_dir={out}"])
    before = snapshot(out)
    with pytest.raises(SystemExit) as exit:  # the plan refuses: nothing moves
        main(["--restart", *argv, f"out_dir={out}", "objectives=[]"])
    assert exit.value.code == 2 and snapshot(out) == before and not list(tmp_path.glob("pareto.previous-*"))
    main(["--restart", *argv, f"out_dir={out}", "count=3"])
    [aside] = tmp_path.glob("pareto.previous-*")
    assert snapshot(aside) == {k: v for k, v in before.items() if k != ".lock"}
    assert json.loads((out / "manifest.json").read_text())["counts"]["selected"] == 3


def test_a_manifest_edited_by_hand_is_refused(toy, tmp_path):
    """Its config (or stage, or inputs) edited after the run wrote it: the digest recorded with
    them no longer matches, and a resume is refused; a manifest without one too."""
    from etagent.direct_rollout.run import plan
    from etagent.rundir import ManifestEdited, claim_output

    out = tmp_path / "rollouts"
    argv = [f"model={toy / 'model'}", f"questions={toy / 'questions' / 'rl.jsonl'}", f"out_dir={out}", "limit=1"]
    schema = SCHEMAS["direct_rollout"][0]
    claim("direct_rollout", argv, plan)
    manifest = json.loads((out / "manifest.json").read_text())
    changed = load_settings("direct_rollout", "tiny", [*argv, "n=2"])
    config = dataclasses.asdict(changed)
    # the edit a careless user makes to pass a rerun with n=2: the manifest's config says n=2 too
    (out / "manifest.json").write_text(json.dumps({**manifest, "config": {**manifest["config"], "n": 2}}, indent=2))
    with pytest.raises(ManifestEdited, match="its stage, config or inputs are not as its run wrote them"):
        with claim_output(out, stage="direct_rollout/stage1", schema=schema, config=config):
            pass
    (out / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "digest"}))
    with pytest.raises(ManifestEdited, match="it has no digest of them"):
        with claim_output(out, stage="direct_rollout/stage1", schema=schema, config=config):
            pass
    (out / "manifest.json").write_text(json.dumps(manifest, indent=4))  # as written, however laid out
    assert claim("direct_rollout", argv, plan)["status"] == "running"
