"""The declarative path: the spec, its plan, the handle, thaws, optimizers, checks, state."""
