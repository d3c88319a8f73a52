"""Benchmarks that print numbers; peers are measured in the same run."""
