"""An example third-party millm feature plugin."""
