"""The model: its layers (attention, the CPU linear), the model classes, and the weight loader."""
