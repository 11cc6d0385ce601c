"""The local retrieval service: ``etagent.retriever.build`` makes an index from a corpus,
``etagent.retriever.server`` serves it over HTTP (Search-R1's and the paper's contracts)."""

from etagent import one_name
from etagent.config import register_stage_schema
from etagent.retriever.config import RetrieverConfig

one_name(__name__)

# configs/retriever/ is typed by RetrieverConfig (each preset starts from it: defaults [_schema, ...])
register_stage_schema("retriever", RetrieverConfig)
