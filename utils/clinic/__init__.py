"""Lab 07's code, the porting clinic: the environment doctor, the divergence finder, porting faults, traces."""
