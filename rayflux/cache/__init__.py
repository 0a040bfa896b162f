"""The cache stage: images and captions in, validated Parquet shards of latents and text embeddings out."""
