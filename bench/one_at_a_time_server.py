"""The peers' retriever design, for bench/bench_retriever.py only: every request encodes its own queries
and searches inside the async request handler (blocking the event loop), as FlashRAG's
host_wiki.py and Search-R1's retrieval server do. It reuses our index files and encoder model,
run by torch as theirs is (``encoder.runtime=torch`` whatever the overrides say), so that the
comparison measures our serving design and our encoder's runtime against theirs.

    python bench/one_at_a_time_server.py INDEX_DIR PORT TORCH_THREADS
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from etagent.config import load_settings
from etagent.retriever.server import Index


class RetrieveRequest(BaseModel):
    queries: list[str]
    topk: int = 3
    return_scores: bool = False


def main() -> None:
    index_dir, port, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    cfg = load_settings("retriever", "tiny", [f"index_dir={index_dir}", *sys.argv[4:], "encoder.runtime=torch"])
    index = Index(Path(index_dir), cfg.serve, cfg.encoder)
    app = FastAPI()

    @app.post("/retrieve")
    async def retrieve(request: RetrieveRequest):
        hits, _, _ = index.dense(request.queries, request.topk)  # blocks the loop, like the peers
        docs = index.documents([p for row in hits for p, _ in row])
        return {"result": [[{"document": docs[p], "score": s} for p, s in row] for row in hits]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
