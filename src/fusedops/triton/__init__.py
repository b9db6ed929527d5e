"""Triton implementations of the fused operators."""
