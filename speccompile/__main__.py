"""`python -m speccompile ...`: the command line, as the `speccompile` script runs it."""

from speccompile.cli import main

if __name__ == "__main__":
    main(prog_name="speccompile")
