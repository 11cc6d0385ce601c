"""The local retrieval service: ``retriever.build`` makes an index from a corpus,
``retriever.server`` serves it over HTTP (Search-R1's and the paper's contracts)."""
