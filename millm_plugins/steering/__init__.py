"""SAE feature steering (in progress: SAE loading and the steering-set model exist; the
management API, inline steering and the report header are the next steps)."""
