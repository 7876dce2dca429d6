"""Recording runs in MLflow: the run and its writes, the outbox that keeps them through outages,
the tracking process, runs left behind by killed jobs, and the store's lock. No torch."""
