"""Same-host groups: ranks on one host reduce through shared memory; one leader uploads."""
