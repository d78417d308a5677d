"""Benchmarks: one JSON line per case on stdout."""
