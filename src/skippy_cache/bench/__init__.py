"""`skippy-cache bench`: skippy-cache against the servers its users would otherwise run."""

from skippy_cache.bench.cli import BenchConfig, BenchOutcome, bench, main
from skippy_cache.bench.run import FULL, QUICK, WORKLOADS, Measurement, Sizes
from skippy_cache.bench.targets import TargetSpec, parse_url_option

__all__ = [
    "FULL",
    "QUICK",
    "WORKLOADS",
    "BenchConfig",
    "BenchOutcome",
    "Measurement",
    "Sizes",
    "TargetSpec",
    "bench",
    "main",
    "parse_url_option",
]
