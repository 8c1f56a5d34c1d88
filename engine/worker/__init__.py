"""What executes a step on each rank: the model runner, the KV cache engine, the rank's state, the TP workers."""
