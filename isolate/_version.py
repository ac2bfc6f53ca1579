"""The version of isolate, in a module of its own so any part of the package can read it."""

__version__ = "0.1.0"
