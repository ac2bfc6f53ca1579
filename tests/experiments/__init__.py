"""The experiments package: the suite, its configs, data, benchmarks and reproducibility."""
