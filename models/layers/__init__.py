"""Layers of the hybrid runtime: Mamba2 mixer, attention, MLP / MoE, norms."""
