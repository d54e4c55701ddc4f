"""OpenAI's Responses API (``/v1/responses``), served as chat completions through the one request pipeline."""
