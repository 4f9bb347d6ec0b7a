"""Apply stage: rewrite the caller's model in place to run as a plan says (FSDP2 for more than one GPU)."""
