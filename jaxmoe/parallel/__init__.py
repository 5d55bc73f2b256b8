"""Parallel execution: expert-parallel dispatchers (and, later, pipeline stages)."""
