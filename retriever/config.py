"""The schema of configs/retriever/ (retriever/build.py, retriever/server.py): one dataclass per
group, field names and types only. The values, and what each means, are in
configs/retriever/_base.yaml and the presets; registered with Hydra in retriever/__init__.py, so a
key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class EncoderSettings:
    kind: str = MISSING
    model: str = MISSING
    query_prefix: str = MISSING
    passage_prefix: str = MISSING
    pooling: str = MISSING
    max_length: int = MISSING
    batch_size: int = MISSING
    device: str = MISSING
    fp16: bool = MISSING


@dataclass
class IndexBuildSettings:
    chunk_size: int = MISSING
    index_type: str = MISSING
    hnsw_m: int = MISSING
    hnsw_ef_construction: int = MISSING
    ivf_lists: int = MISSING
    pq_m: int = MISSING
    train_size: int = MISSING
    faiss_gpu: bool = MISSING
    bm25: bool = MISSING
    keep_embeddings: bool = MISSING


@dataclass
class ServeConfig:
    """The ``serve`` group. The server reads it as this object (:func:`etagent.config.build`),
    not as the DictConfig: attribute access on a DictConfig is slow on the per-request path."""

    host: str = MISSING
    port: int = MISSING
    default_method: str = MISSING
    max_batch: int = MISSING
    max_wait_ms: float = MISSING
    max_queries: int = MISSING
    max_query_chars: int = MISSING
    max_topk: int = MISSING
    max_body_bytes: int = MISSING
    token_env: str | None = MISSING
    nprobe: int = MISSING
    ef_search: int = MISSING
    faiss_gpu: bool = MISSING
    torch_threads: int = MISSING


@dataclass
class RetrieverConfig:
    corpus: str = MISSING
    index_dir: str = MISSING
    seed: int = MISSING
    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    build: IndexBuildSettings = field(default_factory=IndexBuildSettings)
    serve: ServeConfig = field(default_factory=ServeConfig)
