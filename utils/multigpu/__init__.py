"""Lab 06's code: GPU topology, collectives measured like nccl-tests, ranks under torchrun, tensor parallelism."""
