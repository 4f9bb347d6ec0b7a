"""The instruments that watch a training step without running it for real: fake twins of models and
batches (with quantized bases' state and the mixture-of-experts routing bound the fake mode
profiles), and the live-bytes tracker that counts every storage and prices every op."""
