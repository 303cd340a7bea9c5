"""Fuzzing helpers: seeded generators of bad inputs and the runners that feed them to ft (job files: configs, raw,
runner)."""
