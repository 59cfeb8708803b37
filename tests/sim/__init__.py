"""Deterministic simulation of the pure core (``python -m tests.sim --help``)."""
