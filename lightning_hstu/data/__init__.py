"""LightningDataModules."""
