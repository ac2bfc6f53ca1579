"""isolate.certificates: what a run froze, trained, merged and tied, from its checkpoints."""
