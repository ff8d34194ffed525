"""Shared building blocks for the byhand training scripts (one concept per module)."""
