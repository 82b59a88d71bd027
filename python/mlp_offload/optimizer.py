"""The optimizer wrapper (see issue: python)."""
