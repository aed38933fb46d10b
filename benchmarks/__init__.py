"""durably's benchmarks (a package so that ``--app benchmarks.bench_app:app`` imports)."""
