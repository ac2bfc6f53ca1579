"""Ways in and out of isolate: from finetuning-scheduler's schedules
(:mod:`isolate.interop.migrate`), to a plain checkpoint that needs no isolate
(:mod:`isolate.interop.leave`), and a default schedule written from a model's structure
(:mod:`isolate.interop.schedules`). Each is also a verb of the ``isolate`` command."""
