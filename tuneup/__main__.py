"""`python -m tuneup` runs the command line."""

from .entry import main

main()
