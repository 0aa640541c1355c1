"""The HSTU workload: batches, the balanced shuffler, and (to come) the model and its TorchRec tasks."""
