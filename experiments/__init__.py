"""Experiments: the Hydra training entry point, models, data sets and loggers."""
