"""Composing the job: Hydra callbacks, config groups and recipes, the hardware-aware resolvers and the
reasons they give, validation of every key, and one-line errors for bad input. No torch."""
