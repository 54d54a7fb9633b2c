"""Draft proposers, one file per speculative method (algorithms.md)."""
