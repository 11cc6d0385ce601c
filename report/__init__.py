"""One self-contained HTML page per run: pipeline, curves, tables, charts and a trajectory browser (entry: etagent.report.run)."""

from etagent import one_name

one_name(__name__)
