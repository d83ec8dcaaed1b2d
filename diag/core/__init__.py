"""The core layer: models, inputs, running, accumulators; the streaming engine and the state it fills."""
