"""The schema of configs/retriever/ (retriever/build.py, retriever/server.py): one dataclass per
group, field names and types only. The values, and what each means, are in
configs/retriever/_base.yaml and the presets; registered with Hydra in retriever/__init__.py, so a
key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from omegaconf import MISSING

from etagent.settings import (
    FREE,
    InputData,
    NonNegativeFloat,
    NonNegativeInt,
    OneOf,
    OutputFolder,
    Port,
    PositiveInt,
    Seed,
    group,
)


@group
class EncoderSettings:
    kind: Annotated[str, OneOf("sentence-transformers", "transformers")] = MISSING
    # "minilm" (the packaged all-MiniLM-L6-v2), a local folder or a hub id: resolved by the encoder
    model: str = MISSING
    query_prefix: str = MISSING
    passage_prefix: str = MISSING
    pooling: Annotated[str, OneOf("mean", "cls")] = MISSING
    max_length: PositiveInt = MISSING
    batch_size: Annotated[PositiveInt, FREE] = MISSING
    device: Annotated[str, OneOf("cpu", "cuda", "auto"), FREE] = MISSING
    # how the vectors are computed, not what they are of (the same to about 1e-7): free
    runtime: Annotated[str, OneOf("torch", "onnxruntime"), FREE] = MISSING
    fp16: bool = MISSING


@group
class IndexBuildSettings:
    chunk_size: PositiveInt = MISSING
    index_type: Annotated[str, OneOf("Flat", "HNSW", "IVF-PQ")] = MISSING
    hnsw_m: PositiveInt = MISSING
    hnsw_ef_construction: PositiveInt = MISSING
    ivf_lists: PositiveInt = MISSING
    pq_m: PositiveInt = MISSING
    train_size: PositiveInt = MISSING
    faiss_gpu: Annotated[bool, FREE] = MISSING
    bm25: bool = MISSING
    keep_embeddings: bool = MISSING


@group
class ServeConfig:
    """The ``serve`` group. The server reads it as this object (:func:`etagent.config.build`),
    not as the DictConfig: attribute access on a DictConfig is slow on the per-request path."""

    host: str = MISSING
    port: Port = MISSING
    default_method: Annotated[str, OneOf("dense", "bm25", "hybrid")] = MISSING
    max_batch: PositiveInt = MISSING
    max_wait_ms: NonNegativeFloat = MISSING
    max_queries: PositiveInt = MISSING
    max_query_chars: PositiveInt = MISSING
    max_topk: PositiveInt = MISSING
    max_body_bytes: PositiveInt = MISSING
    token_env: str | None = MISSING
    nprobe: PositiveInt = MISSING
    ef_search: PositiveInt = MISSING
    faiss_gpu: bool = MISSING
    torch_threads: NonNegativeInt = MISSING


@group
class RetrieverConfig:
    # the build's input and output; the server reads index_dir (retriever/server.py checks it)
    corpus: InputData = MISSING
    index_dir: OutputFolder = MISSING
    seed: Seed = MISSING
    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    build: IndexBuildSettings = field(default_factory=IndexBuildSettings)
    # how the index is served, not what it holds
    serve: Annotated[ServeConfig, FREE] = field(default_factory=ServeConfig)
