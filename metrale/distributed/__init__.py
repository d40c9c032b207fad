"""Tensor parallelism on torch.distributed: the group of ranks (`parallel_state`) and how a
tensor splits across them (`sharding`)."""
