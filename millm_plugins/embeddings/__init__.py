"""``/v1/embeddings`` on engines that can embed."""
