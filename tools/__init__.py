"""Contributor tools: the run driver and the accelerator scripts (see tools/README.md)."""
