"""A helper child process for tests/orchestrator/test_child_launcher.py (run as `python -m`)."""
