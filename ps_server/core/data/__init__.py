"""The data dealing: which examples each push trains on, and that each counts once.

    from ps_server.core.data.cursor import Cursor, DataPlan, EpochLedger
    from ps_server.core.data.tasks import TaskQueue

Owns:

- ``cursor``: the job's data plan (``DataPlan``); the cluster's data cursor of elastic
  sync (each global batch in fixed micro-batches, dealt to the live workers); the
  ledger of each epoch's examples (``EpochLedger``);
- ``tasks``: async and ssp batches as tasks under leases, each applied exactly once,
  counted in the same ledger.

May import, of the core, ``ps_server.core.errors`` alone (and ``ps_common.batches``, the
seeded sequence every process computes): it deals indices and knows no gradient, store
or mode (``tests/test_layers.py`` holds the rule table).
"""
