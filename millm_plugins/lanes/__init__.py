"""Scheduling lanes: ``class`` (or an ``@agent`` model suffix) on generation requests."""
