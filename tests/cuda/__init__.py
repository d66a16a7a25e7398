"""The CUDA test tier (``pytest -m cuda`` / ``make test-gpu``): skipped without a GPU."""
