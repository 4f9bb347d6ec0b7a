"""`python -m autoplan ...` runs the command line, as the `autoplan` script does."""

from autoplan.cli.main import run

if __name__ == "__main__":
    run()
