"""`python -m batchgen`: the command line."""

from .cli.commands import main

main()
