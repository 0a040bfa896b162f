"""The training stage: FLUX flow-matching LoRA on Ray Train workers."""
