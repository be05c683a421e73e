"""Baton benchmarks (run as ``python -m bench.<scenario>``); separate from the tests."""
