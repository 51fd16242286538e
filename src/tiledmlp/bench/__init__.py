"""Benchmark harness: variants, FLOP and memory measurement, sweeps, reports.

Sits above the ops; tests use its measurement helpers so that numbers asserted in tests and
numbers reported by the benchmark come from the same code.
"""
