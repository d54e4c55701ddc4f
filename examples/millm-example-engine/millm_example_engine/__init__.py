"""An example third-party millm engine plugin: a byte-level bigram model."""
