"""LightningModules."""
