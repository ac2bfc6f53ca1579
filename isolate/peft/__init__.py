"""PEFT integration (stub)."""
