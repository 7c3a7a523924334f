"""User tools on top of the backend: warm-up, amortisation, the compile spike and its zoo, and
the reliability harnesses the benchmarks run (random-convolution checker, fault injection,
dynamic shapes)."""
