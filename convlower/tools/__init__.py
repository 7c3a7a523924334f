"""User tools on top of the backend: warm-up, amortisation, the compile spike and its zoo."""
