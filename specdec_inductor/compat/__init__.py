"""Drop-in adapters for users of other serving stacks (see sglang.py)."""
