"""``tfps.keras.Strategy``: the Keras integration (``worker.keras`` has the whole story).

    import tfps.keras
    strategy = tfps.keras.Strategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(train_dataset, epochs=5, validation_data=test_dataset)
"""

from worker.keras import Strategy

__all__ = ["Strategy"]
