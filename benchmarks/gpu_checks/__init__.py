"""The checks `benchmarks/gpu_check.py` runs, one module per subject, each check a function
`check_*(device: str, **params) -> dict` that returns its figures and `ok` (whether its pass criterion held).
Each runs in a process of its own (the runner's); nothing heavy is imported here."""
