"""The embedded toy world (``world``, ``seeds``), its tiny model (``model``), their settings
(``config``) and the command that builds them (``build``): what the demo and the tests run on."""
