"""Probes: linear detectors over the residual stream (or an attached SAE's features),
imported as documents, armed through gates and run on every row of live traffic."""
