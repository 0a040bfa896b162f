"""rayflux: FLUX LoRA fine-tuning on Ray (Ray Data for the cache, Ray Train for training)."""

__version__ = "0.1.0"
