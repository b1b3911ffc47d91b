"""Scripts beside the package: building the demo pair, fetching real models, fuzzing and soaking the
server, and measuring (`tools.measure`). Run them from the repository root as `python -m tools.NAME`:
the measurements and the scripts that use the tests' helpers (make_tiny_pair, fuzz_serve) need it."""
