"""Inductor lowerings and graph passes for the specdec backend (see README.md)."""
