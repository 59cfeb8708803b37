"""Deterministic simulation of the real shell on a virtual-time loop
(``python -m tests.sim --help``)."""
