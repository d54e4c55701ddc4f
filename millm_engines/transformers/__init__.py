"""The Hugging Face transformers engine: its own batch-first decode loop over a
``AutoModelForCausalLM``."""
