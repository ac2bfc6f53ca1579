"""The README and the examples: what a newcomer reads and runs."""
