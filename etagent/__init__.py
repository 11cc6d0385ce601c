"""ET-Agent toolkit: the shared core every stage uses.

Modules: ``protocol`` (the tool-integrated reasoning text protocol), ``records`` (artifacts and
their readers/writers), ``scoring`` (answer metrics and the LLM judge), ``net`` (HTTP calls with
timeouts and retries), ``toy`` (the embedded toy world and tiny model), ``cli`` (the ``etagent``
command).
"""

__version__ = "0.1.0"
