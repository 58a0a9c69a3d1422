"""NIXL, Mooncake Transfer Engine and DLSlime driven through their own Python APIs on exactly the
work of a `kvfabric bench` row: same pool sizes, block sizes, random block places, bytes per
batch and batches in flight; warm-up untimed; median of 3 runs; destination poisoned first and
verified block by block after the timed phase."""
