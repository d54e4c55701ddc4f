"""Circuits: multi-layer interventions across several SAEs, steered with one intensity dial
and reported with the evidence ladder (``X-miLLM-Circuit-Rung``). See docs/circuits.md."""
