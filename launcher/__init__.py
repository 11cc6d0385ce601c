"""The ``etagent`` command (:mod:`etagent.launcher.main`): the one place that knows every stage by name.
It sits outside the core, which imports no stage, and beside the stages, which import no other
stage."""

from etagent import one_name

one_name(__name__)
