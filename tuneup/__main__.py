"""`python -m tuneup` runs the command line."""

from .cli import main

main()
