"""Multi-process runs (DDP, FSDP2, HSDP, tensor parallel): 2 CPU processes, gloo."""
