"""Reproducible measurements: each module prints a table and writes JSON with --json."""
