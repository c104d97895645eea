"""The loop: a run's start and set-up, the trainer, evaluation, records, preemption."""
