"""The adapter and its export: peft LoRA targets and files, LoRA+'s parameter groups, kohya keys, the exported LoRA
files, the EMA of the adapter, the frozen base's lower-precision weights."""
