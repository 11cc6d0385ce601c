"""Build a retrieval index from a corpus: dense (faiss) and lexical (BM25).

    python -m etagent.retriever.build [--preset tiny|paper] [overrides]       # or: etagent retriever build
    python -m etagent.retriever.build corpus=data/wiki-18.jsonl index_dir=data/wiki-18-e5 --preset paper

Reads a corpus in the FlashRAG/Search-R1 JSONL format (``id``, ``contents``, optional
``title``). Before anything is written, one pass reads every passage and refuses a bad line or an
id that an earlier line holds (naming file, line and id: the server's hybrid search fuses
passages by id, so two passages under one id would come back as one); a second build into the
same ``index_dir`` while one runs is refused (the lock of etagent/rundir.py). Then it streams the
corpus in chunks of ``build.chunk_size`` passages. For each chunk it encodes the
passages, writes their vectors to ``embeddings/part-NNNNN.npy`` and their text to the document
store (``docs.sqlite``), and records the chunk as done in the same transaction: a build killed at
any point resumes from the first unfinished chunk and ends with the same index, byte for byte, as
an uninterrupted one. Memory stays bounded by a chunk plus the index itself.

Then it builds the faiss index from the stored vectors: ``Flat`` (exact inner product, the
paper's), ``HNSW`` or ``IVF-PQ`` (compressed, for corpora that do not fit in RAM as floats); and,
if ``build.bm25``, a BM25 index (``bm25s``). Writes ``index.faiss``, ``bm25/``, ``docs.sqlite``,
``manifest.json`` into ``index_dir``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sqlite3
import time
from array import array
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np

from etagent.errors import SettingError, UserError, exit_on_user_error
from etagent.progress import Progress
from etagent.records import RecordError, input_identity, iter_jsonl, write_manifest
from etagent.retriever.config import EncoderSettings, IndexBuildSettings, RetrieverConfig
from etagent.retriever.encoder import check_encoder
from etagent.rundir import changed_settings, claim_output, completed
from etagent.settings import check_paths, free_keys

log = logging.getLogger("etagent.retriever.build")

SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (position INTEGER PRIMARY KEY, id TEXT NOT NULL, title TEXT, contents TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (chunk INTEGER PRIMARY KEY, first INTEGER NOT NULL, count INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def read_passages(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, passage {id, title, contents}) for every passage; a bad line names file,
    line and field."""
    for number, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise RecordError(path, number, "(record)", "expected a JSON object")
        contents = row.get("contents", row.get("text"))
        if not isinstance(contents, str) or not contents.strip():
            raise RecordError(path, number, "contents", "missing or empty")
        if "id" not in row:
            raise RecordError(path, number, "id", "missing")
        yield number, {"id": str(row["id"]), "title": row.get("title"), "contents": contents}


def check_corpus(path: Path) -> int:
    """Every passage of the corpus readable and every id unique (as the server returns it: a
    string, so ``1`` and ``"1"`` are one id), before anything is written; returns the number of
    passages. A repeated id is refused at its second line, naming the first. Memory stays at 8
    bytes per passage (a hash of each id), so a corpus of tens of millions of passages is checked
    in one pass; a second pass, only when two hashes are equal, finds the lines."""
    digests = array("Q")
    for _, passage in read_passages(path):
        digests.append(_id_digest(passage["id"]))
    hashes = np.frombuffer(digests, dtype=np.uint64) if digests else np.zeros(0, dtype=np.uint64)
    values, counts = np.unique(hashes, return_counts=True)
    repeated = set(values[counts > 1].tolist())
    if repeated:
        first_line: dict[str, int] = {}
        for number, passage in read_passages(path):
            if _id_digest(passage["id"]) not in repeated:
                continue
            if passage["id"] in first_line:
                raise RecordError(
                    path,
                    number,
                    "id",
                    f"{passage['id']!r} is the id of line {first_line[passage['id']]} too: every passage needs its own id "
                    "(hybrid search fuses passages by id)",
                )
            first_line[passage["id"]] = number
    return len(hashes)


def _id_digest(passage_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(passage_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def read_corpus(path: Path, chunk_size: int) -> Iterator[list[dict]]:
    """Chunks of passages {id, title, contents}; a bad line names file, line and field."""
    chunk: list[dict] = []
    for _, passage in read_passages(path):
        chunk.append(passage)
        if len(chunk) == chunk_size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def open_store(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(SCHEMA)
    return db


def encode_corpus(corpus: Path, chunk_size: int, settings: EncoderSettings, out: Path, db: sqlite3.Connection) -> int:
    """Encode every chunk not yet done; return the number of passages."""
    from etagent.retriever.encoder import Encoder

    done = {chunk for (chunk,) in db.execute("SELECT chunk FROM chunks")}
    parts = out / "embeddings"
    parts.mkdir(exist_ok=True)
    encoder = None
    position = 0
    progress = Progress("encoding passages", None, "passage")
    for k, chunk in enumerate(read_corpus(corpus, chunk_size)):
        part = parts / f"part-{k:05d}.npy"
        if k in done and part.exists():
            position += len(chunk)
            progress.update(len(chunk))
            continue
        if encoder is None:  # loading the model is slow: only when there is work
            encoder = Encoder(settings)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('dim', ?)", (str(encoder.dim),))
        vectors = encoder.encode_passages([p["contents"] for p in chunk])
        tmp = part.with_suffix(".tmp.npy")
        np.save(tmp, vectors)
        os.replace(tmp, part)
        db.execute("BEGIN")
        db.executemany(
            "INSERT OR REPLACE INTO docs VALUES (?, ?, ?, ?)",
            [(position + i, p["id"], p["title"], p["contents"]) for i, p in enumerate(chunk)],
        )
        db.execute("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?)", (k, position, len(chunk)))
        db.execute("COMMIT")
        position += len(chunk)
        progress.update(len(chunk))
    progress.close()
    return position


def import_faiss():
    import faiss  # the retriever extra; missing, it is one line naming the extra (etagent/errors.py)

    return faiss


def build_faiss(b: IndexBuildSettings, seed: int, out: Path, n: int):
    """The faiss index of the stored vectors, written to ``out/index.faiss``."""
    faiss = import_faiss()

    parts = sorted((out / "embeddings").glob("part-*.npy"))
    dim = np.load(parts[0], mmap_mode="r").shape[1]
    if b.index_type == "Flat":
        index = faiss.IndexFlatIP(dim)
    elif b.index_type == "HNSW":
        index = faiss.IndexHNSWFlat(dim, b.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = b.hnsw_ef_construction
    elif b.index_type == "IVF-PQ":  # its passages were counted against its lists before the claim (check_passages)
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFPQ(quantizer, dim, b.ivf_lists, b.pq_m, 8, faiss.METRIC_INNER_PRODUCT)
        sample = _training_sample(parts, b.train_size, seed=seed)
        if b.faiss_gpu and faiss.get_num_gpus() > 0:
            gpu_index = faiss.index_cpu_to_all_gpus(index)
            gpu_index.train(sample)
            index = faiss.index_gpu_to_cpu(gpu_index)
        else:
            index.train(sample)
    else:
        raise ValueError(f"build.index_type must be Flat, HNSW or IVF-PQ, got {b.index_type!r}")
    progress = Progress("indexing", len(parts), "chunk")
    for part in parts:
        index.add(np.ascontiguousarray(np.load(part)))
        progress.update(1)
    progress.close()
    if index.ntotal != n:
        raise RuntimeError(f"index holds {index.ntotal} vectors but the corpus has {n} passages")
    tmp = out / "index.faiss.tmp"
    faiss.write_index(index, str(tmp))
    os.replace(tmp, out / "index.faiss")
    return index


def _training_sample(parts: list[Path], size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = [np.load(p, mmap_mode="r").shape[0] for p in parts]
    total = sum(lengths)
    picks = np.sort(rng.choice(total, size=min(size, total), replace=False))
    out, offset = [], 0
    for part, length in zip(parts, lengths):
        local = picks[(picks >= offset) & (picks < offset + length)] - offset
        if len(local):
            out.append(np.load(part, mmap_mode="r")[local])
        offset += length
    return np.ascontiguousarray(np.concatenate(out))


def build_bm25(out: Path, db: sqlite3.Connection) -> None:
    from etagent.tools.search import BM25Index

    texts = [contents for (contents,) in db.execute("SELECT contents FROM docs ORDER BY position")]
    tmp = out / "bm25.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    BM25Index(texts).save(tmp)
    shutil.rmtree(out / "bm25", ignore_errors=True)
    os.replace(tmp, out / "bm25")


def check_build(cfg: RetrieverConfig) -> dict:
    """What a build can refuse without reading the whole corpus, before the index folder is
    claimed: the corpus present and not empty, the encoder there, the packages the build needs
    (faiss; those of the encoder's kind and runtime) and the device it asks for. Returns the
    corpus's identity (etagent.records.input_identity)."""
    [corpus_input] = [input_identity(key, path) for key, path, _ in check_paths(RetrieverConfig, asdict(cfg))]
    with open(cfg.corpus, "rb") as f:
        if not any(line.strip() for line in f):  # stops at the first passage
            raise UserError(f"{cfg.corpus}: no passages (the corpus is empty): an index of nothing would serve no search")
    import_faiss()  # missing, it is one line naming the extra (etagent/errors.py)
    check_encoder(cfg.encoder)  # a missing encoder is refused before the index folder is made
    return corpus_input


def check_passages(cfg: RetrieverConfig) -> int:
    """Every passage of the corpus readable and its id unique (:func:`check_corpus`), and as many
    as the index type needs (IVF-PQ trains 39 points per list, as faiss asks); returns how many."""
    n = check_corpus(Path(cfg.corpus))
    if cfg.build.index_type == "IVF-PQ" and n < 39 * cfg.build.ivf_lists:
        raise SettingError(
            "build.ivf_lists",
            f"is {cfg.build.ivf_lists}: IVF-PQ with that many lists needs at least {39 * cfg.build.ivf_lists} passages, and {cfg.corpus} "
            f"has {n}; lower it, or set build.index_type=Flat",
        )
    return n


def plan(cfg: RetrieverConfig) -> None:
    """Everything a build can refuse before it claims its index folder (:func:`check_build`,
    :func:`check_passages`); what the folder holds is checked by :func:`build_index` itself."""
    check_build(cfg)
    check_passages(cfg)


def build_index(cfg: RetrieverConfig) -> dict:
    """Encode, index and store the corpus (resuming a killed build); the build's metrics."""
    started = time.time()
    corpus_input = check_build(cfg)
    out = Path(cfg.index_dir)
    if (out / "index.faiss").exists():
        previous = completed(out)  # refused where its manifest was edited since
        same = previous is not None and not changed_settings(previous.get("config") or {}, asdict(cfg), free_keys(RetrieverConfig))
        if same and previous.get("inputs") == [corpus_input]:
            print(f"index in {out} is already built ({previous['counts']['passages']} passages); nothing to do")
            return previous["metrics"]
    corpus = Path(cfg.corpus)
    check_passages(cfg)
    # what the stored vectors are of: the corpus's content (wherever it lies) and the encoder
    encoder = {k: v for k, v in asdict(cfg.encoder).items() if k not in free_keys(EncoderSettings)}
    signature = json.dumps({"corpus": corpus_input["sha256"], "encoder": encoder, "chunk_size": cfg.build.chunk_size}, sort_keys=True)
    check_stored_vectors(out, signature)
    # one build per folder at a time: the lock every stage takes on its out_dir; the build checks
    # its own resume (the stored vectors' signature, above), so the claim does not
    with claim_output(out, stage="etagent.retriever.build", schema=RetrieverConfig, config=asdict(cfg), resumes=False):
        return _build(cfg, out, corpus, corpus_input, signature, started)


def check_stored_vectors(out: Path, signature: str) -> None:
    """Refuse to resume a folder whose stored vectors are of another corpus or encoder, before the
    folder is claimed: a refused build leaves it as it was (the store is only read; SQLite's
    transient -wal and -shm files go when the connection closes, where a read-only connection
    would leave them)."""
    store = out / "docs.sqlite"
    if not store.is_file():
        return
    db = sqlite3.connect(store)
    try:
        previous = db.execute("SELECT value FROM meta WHERE key = 'signature'").fetchone()
    except sqlite3.OperationalError:  # a store a kill left before its tables were made
        previous = None
    finally:
        db.close()
    if previous and previous[0] != signature:
        raise UserError(
            f"{out} holds vectors of another corpus (or the corpus has changed since) or another encoder; "
            "use a new index_dir, or rerun with --restart to build it again"
        )


def _build(cfg: RetrieverConfig, out: Path, corpus: Path, corpus_input: dict, signature: str, started: float) -> dict:
    db = open_store(out / "docs.sqlite")
    db.execute("INSERT OR REPLACE INTO meta VALUES ('signature', ?)", (signature,))
    t0 = time.time()
    n = encode_corpus(corpus, cfg.build.chunk_size, cfg.encoder, out, db)
    db.execute("DELETE FROM docs WHERE position >= ?", (n,))  # a corpus that shrank since a killed run
    t1 = time.time()
    index = build_faiss(cfg.build, cfg.seed, out, n)
    t2 = time.time()
    if cfg.build.bm25:
        build_bm25(out, db)
    t3 = time.time()
    db.close()
    if not cfg.build.keep_embeddings:
        shutil.rmtree(out / "embeddings")
    metrics = {
        "passages": n,
        "dim": index.d,
        "index_type": cfg.build.index_type,
        "bm25": bool(cfg.build.bm25),
        "seconds": {"encode": round(t1 - t0, 2), "faiss": round(t2 - t1, 2), "bm25": round(t3 - t2, 2)},
    }
    write_manifest(
        out,
        stage="etagent.retriever.build",
        config=asdict(cfg),
        inputs=[corpus_input],
        counts={"passages": n},
        seed=cfg.seed,
        started_at=started,
        metrics=metrics,
    )
    print(
        f"index in {out}: {n} passages, {cfg.build.index_type} (dim {index.d}){', BM25' if cfg.build.bm25 else ''}; encode {t1 - t0:.1f}s, faiss {t2 - t1:.1f}s, bm25 {t3 - t2:.1f}s"
    )
    return metrics


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    from etagent.stage_cli import stage_configs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is noise
    for cfg in stage_configs("retriever", argv, prog="python -m etagent.retriever.build", doc=__doc__, plan=plan):
        build_index(cfg)


if __name__ == "__main__":
    main()
