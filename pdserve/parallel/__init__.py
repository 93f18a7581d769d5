"""Model parallelism: tensor-parallel layers over a torch.distributed process group."""
