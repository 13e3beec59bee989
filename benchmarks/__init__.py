"""fmoe benchmarks: ``python -m benchmarks.run``."""
