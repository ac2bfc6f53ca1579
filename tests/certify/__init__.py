"""isolate.certificates: certificates from two checkpoints alone."""
