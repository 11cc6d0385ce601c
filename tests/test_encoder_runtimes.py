"""The retriever's encoder on its two runtimes (retriever/encoder.py): the model exported to ONNX
and run by onnxruntime gives the vectors torch gives, for both encoder kinds, every batch size and
texts of every length the toy world holds (and the odd ones: empty, whitespace, past max_length);
and the settings onnxruntime cannot take are refused before a build claims its folder."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from etagent.config import load_settings
from etagent.retriever.encoder import Encoder

TOLERANCE = 1e-5


def texts_of(toy: Path) -> list[str]:
    """The toy's held-out questions and a sample of its passages, plus texts at the edges."""
    questions = [json.loads(line)["question"] for line in (toy / "questions" / "test.jsonl").read_text().splitlines()]
    passages = [json.loads(line)["contents"] for line in (toy / "corpus.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    odd = ["", " ", "x", "Ünïcödé 日本語 text", " ".join(passages[:40])]  # the last is past max_length
    return questions + rng.sample(passages, 60) + odd


@pytest.mark.parametrize("kind", ["sentence-transformers", "transformers"])
def test_onnxruntime_vectors_equal_torchs(toy, kind):
    settings = dataclasses.replace(load_settings("retriever", "tiny", []).encoder, kind=kind, max_length=128)
    onnx = Encoder(dataclasses.replace(settings, runtime="onnxruntime"))
    torch_encoder = Encoder(dataclasses.replace(settings, runtime="torch"))
    # its waiting threads sleep rather than spin: a busy machine's cores stay for the work
    assert onnx.onnx.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    texts = texts_of(toy)
    for batch_size in (1, 5, 64):
        onnx.batch_size = torch_encoder.batch_size = batch_size
        for encode in ("encode_queries", "encode_passages"):
            ours, reference = getattr(onnx, encode)(texts), getattr(torch_encoder, encode)(texts)
            assert ours.shape == reference.shape == (len(texts), 384) and ours.dtype == np.float32
            assert np.abs(ours - reference).max() < TOLERANCE, (kind, batch_size, encode)
            assert np.abs(np.linalg.norm(ours, axis=1) - 1).max() < TOLERANCE
    assert onnx.encode_queries([]).shape == (0, 384)


def test_settings_onnxruntime_cannot_take_are_refused_before_the_build(toy, tmp_path):
    index = tmp_path / "index"
    build = [sys.executable, "-m", "etagent.retriever.build", f"corpus={toy / 'corpus.jsonl'}", f"index_dir={index}"]
    on_gpu = subprocess.run([*build, "encoder.device=cuda"], capture_output=True, text=True, timeout=120)
    assert on_gpu.returncode == 2, on_gpu.stderr[-2000:]
    assert on_gpu.stderr.strip().splitlines()[-1].startswith("error: setting encoder.runtime: is onnxruntime, which runs on the CPU")
    unknown = subprocess.run([*build, "encoder.runtime=tensorrt"], capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "encoder.runtime" in unknown.stderr.strip().splitlines()[-1]
    assert not index.exists()


def test_a_model_that_does_not_start_with_a_transformer_is_refused_before_the_build(toy, tmp_path):
    """A sentence-transformers folder whose modules.json starts with static embeddings: there is no
    transformer to export, so runtime=onnxruntime is refused naming the setting and the module."""
    model = tmp_path / "static"
    model.mkdir()
    modules = [{"idx": 0, "name": "0", "path": "0_StaticEmbedding", "type": "sentence_transformers.models.StaticEmbedding"}]
    (model / "modules.json").write_text(json.dumps(modules))
    index = tmp_path / "index"
    build = [
        sys.executable,
        "-m",
        "etagent.retriever.build",
        f"corpus={toy / 'corpus.jsonl'}",
        f"index_dir={index}",
        f"encoder.model={model}",
    ]
    refused = subprocess.run(build, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: setting encoder.runtime: is onnxruntime, which runs a transformer, and {model} starts with "
        "sentence_transformers.models.StaticEmbedding: set encoder.runtime=torch"
    )
    assert not index.exists()


def test_an_export_that_does_not_give_torchs_hidden_states_is_refused(monkeypatch):
    """The exported graph's outputs are shifted here (a scripted fault, standing in for a trace
    that fixed a shape): the encoder refuses to be made, naming the setting to change."""
    from etagent.errors import SettingError
    from etagent.retriever import encoder

    run = encoder.OnnxTransformer.__call__
    monkeypatch.setattr(encoder.OnnxTransformer, "__call__", lambda self, inputs: run(self, inputs) + 0.01)
    with pytest.raises(SettingError, match=r"encoder\.runtime.*gives hidden states 0\.01 away from torch's: set encoder\.runtime=torch"):
        Encoder(load_settings("retriever", "tiny", []).encoder)
