"""LoRA adapters on the base model: PEFT-format adapters read and checked against the model
(`adapter.py`), the served set by name (`registry.py`) and the per-batch delta of the linears
for requests of different adapters in one batch (`batch.py`)."""
