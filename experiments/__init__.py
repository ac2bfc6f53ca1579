"""Experiments with isolate on MNIST and Fashion-MNIST."""
