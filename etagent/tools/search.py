"""Search results as the agent sees them, and the in-process BM25 index.

:func:`format_documents` turns retrieved documents into the text inserted in ``<result>``: each
document's ``contents`` cut to ``max_doc_chars`` characters (plus "..." when cut), separated by
blank lines. This is the reference's rollout and RL format (4 documents x 1200 characters in the
paper's runs), used by every search backend so trajectories look the same whatever served them.

:class:`BM25Index` is lexical retrieval with ``bm25s``. The toy world's seed trajectories and the
retriever service's BM25 method both use it, so a toy trajectory shows exactly what a live
search would return.
"""

from __future__ import annotations

from collections.abc import Sequence


def format_documents(contents: Sequence[str], max_doc_chars: int = 1200) -> str:
    """The result text for retrieved documents, in rank order."""
    pieces = [text if len(text) <= max_doc_chars else text[:max_doc_chars] + "..." for text in contents]
    return "\n\n".join(piece.strip() for piece in pieces).strip()


class BM25Index:
    """BM25 (Lucene variant, k1 1.5, b 0.75) over a list of texts, with English stopwords."""

    def __init__(self, texts: Sequence[str]):
        import bm25s

        self._bm25s = bm25s
        self.size = len(texts)
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(list(texts), stopwords="en", show_progress=False), show_progress=False)

    def search(self, queries: Sequence[str], k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k document positions and scores per query. Documents with score 0 (no query term
        in common) are left out, so a query may get fewer than k documents."""
        k = min(k, self.size)
        tokens = self._bm25s.tokenize(list(queries), stopwords="en", return_ids=False, show_progress=False)
        # bm25s cannot score a query with no known token; such queries simply find nothing.
        ids: list[list[int]] = [[] for _ in tokens]
        scores: list[list[float]] = [[] for _ in tokens]
        scorable = [i for i, query_tokens in enumerate(tokens) if query_tokens]
        if scorable:
            found, found_scores = self._index.retrieve([tokens[i] for i in scorable], k=k, show_progress=False, n_threads=1)
            for row, i in enumerate(scorable):
                keep = [(int(d), float(s)) for d, s in zip(found[row], found_scores[row]) if s > 0]
                ids[i] = [d for d, _ in keep]
                scores[i] = [s for _, s in keep]
        return ids, scores
