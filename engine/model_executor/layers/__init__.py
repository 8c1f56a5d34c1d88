"""The model's building blocks: paged attention and the CPU linear layer."""
