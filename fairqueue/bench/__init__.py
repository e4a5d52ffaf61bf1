"""Benchmarks run by `manage.py bench`: they drive the real stack, never a model of it."""
