"""Report stage: advice, text, JSON and plots of a plan; prints nothing itself."""
