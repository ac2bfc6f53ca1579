"""Ways in and out of isolate: from finetuning-scheduler's schedules
(:mod:`isolate.interop.migrate`), to a plain checkpoint that needs no isolate
(:mod:`isolate.interop.leave`), and a default schedule written from a model's structure
(:mod:`isolate.interop.schedules`). Each is also a verb of the ``isolate`` command."""

__all__: list[str] = []  # a namespace: each way in or out is a module of its own
