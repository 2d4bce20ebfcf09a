"""Running over several devices and hosts: the mesh and the model's sharding rules (`sharding`),
and several processes as one JAX program (`distributed`: `--nnodes`, the step channel)."""
