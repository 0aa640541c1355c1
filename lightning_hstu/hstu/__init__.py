"""The HSTU workload: its tasks and presets, batches, the balanced shuffler, TorchRec embeddings task by task,
megatron-core gradients, CUDA graphs and the pieces of a step the model shares with the baselines."""
