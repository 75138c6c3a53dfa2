"""Shared test settings: the plugin under test is loaded by pyproject's addopts (-p harness)."""
