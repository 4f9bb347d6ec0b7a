"""Memory stage: the single source of truth for the peak of any set of choices, phase by phase,
on one GPU and per FSDP rank."""
