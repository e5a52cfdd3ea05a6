"""tfps for the user's program: ``import tfps.keras`` (``worker.keras``) trains a Keras model's
own ``model.fit`` on a tfps parameter server. The processes themselves are ``ps-server``,
``ps-worker`` and ``ps-launch`` (README.md)."""
