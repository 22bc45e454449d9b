"""Benchmarks behind `kvpool bench ...` (scripts that print side-by-side ratios, not tests)."""
