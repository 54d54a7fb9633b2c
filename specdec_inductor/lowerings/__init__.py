"""Inductor lowerings and graph passes for the `specdec` backend; the only package that imports
private `torch._inductor` names (see README.md here for what belongs)."""
