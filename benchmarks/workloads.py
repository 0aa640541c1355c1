"""The benchmarks' model shapes, in a module that imports nothing: ``hstu_pipelines.py`` (with TorchRec) and the
scripts that run on torch and triton alone (``hstu_stack.py``, ``rows_kernels.py``, ``gemm_shapes.py``) read the
same numbers."""

WORKLOADS = {
    "light": dict(max_len=256, embedding_dim=128, num_layers=2, num_heads=2, attention_dim=32, hidden_dim=32),
    "heavy": dict(max_len=1024, embedding_dim=512, num_layers=8, num_heads=4, attention_dim=128, hidden_dim=128),
    "seed": dict(max_len=4096, embedding_dim=1024, num_layers=10, num_heads=4, attention_dim=256, hidden_dim=256),
    "seed_w128": dict(max_len=4096, embedding_dim=128, num_layers=10, num_heads=4, attention_dim=128, hidden_dim=128),
}
