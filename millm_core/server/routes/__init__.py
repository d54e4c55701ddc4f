"""Thin endpoints: decode → pipeline → encode."""
