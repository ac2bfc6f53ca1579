"""The tests of isolate, a folder per layer of the package; the autouse guards: conftest.py."""
