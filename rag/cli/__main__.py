"""`python -m rag.cli ...`: the same as `rag ...`."""

from rag.cli.main import main

main()
