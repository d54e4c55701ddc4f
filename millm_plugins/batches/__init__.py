"""OpenAI's Files and Batch APIs, run through the core's one request pipeline."""
