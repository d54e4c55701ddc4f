"""Per-request SAE activations: ``return_sae_activations`` on chat and text completions."""
