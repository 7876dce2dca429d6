"""Training on built objects: the runner, accumulation, objective, schedules, callbacks, checkpoints
and exact resume, distributed ranks. Takes no config, tracker or Hydra object."""
