"""The consistency modes: how pushes become updates of the store, one module per mode.

    from ps_server.core.modes.sync_mode import SyncMode

Owns:

- ``base``: ``Mode``, what every mode gives the server and takes from it (``submit``, the
  one way a push comes in, checked already by ``ParameterServer.submit``, and its
  ``Ticket``), and what a push returns;
- ``sync_mode``: one barrier per step, over ``rounds`` (the deterministic bookkeeping of
  sync rounds), ``aggregation`` (how a round combines gradients: ``RoundSum``, the exact
  weighted mean rounded once) and ``overlap`` (a round speculated block by block while it
  arrives, kept only if the round confirms it);
- ``async_mode``: every push applied on arrival (locked or hogwild);
- ``ssp_mode``: applied on arrival, nobody more than S steps ahead of the slowest;
- ``elastic_mode``: sync rounds whose workers come and go, over ``data.cursor``.

May import, of the core: ``errors``, ``optim`` (the arithmetic), ``store`` (what a mode
updates), ``membership`` (who takes part) and ``data`` (what each push trained on). Not
``parameter_server``, ``checkpoint`` or ``broadcast``, which read the modes
(``tests/test_layers.py`` holds the rule table).
"""
