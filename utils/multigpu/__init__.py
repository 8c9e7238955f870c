"""Lab 06's code: GPU topology, collectives measured like nccl-tests, ranks started and ended by the course (a file store, loopback only), tensor parallelism."""
