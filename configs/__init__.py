"""Hydra configs of gracecomm (a package so that they install as `gracecomm.configs`)."""
