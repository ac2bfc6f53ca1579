"""The ways in and out: migration from finetuning-scheduler, leaving isolate, schedules."""
