"""The agent's tools: search (local retriever, BM25, web) and, with the tools issue, the Python
sandbox, the persistent cache and the concurrent executor."""
