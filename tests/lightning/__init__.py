"""The Lightning integration, with a real, tiny Trainer."""
